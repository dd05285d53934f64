"""The worker side: the processes that make batches.

``workerserver`` (the fork server every worker comes from), ``worker`` (one worker's loop),
``producer`` (one batch: samples read, decoded, augmented, written), ``transforms`` (the ops), and
the decoders (``fastdecode``, ``roidecode`` through ``tjlib``). A worker never loads the master's
machinery: tests/unit/test_structure.py keeps this folder from reaching ``master``, ``ops`` or ``cli``.
"""
