"""The worker side: the processes that make batches.

``workerserver`` (the fork server every worker comes from), ``worker`` (one worker's loop),
``producer`` (one batch: samples read, decoded, augmented, written), ``transforms`` (the ops), and
the decoders (``fastdecode``, ``roidecode`` through ``tjlib``). A worker never loads the master's
machinery: tests/unit/test_structure.py keeps this folder from reaching ``master``, ``ops`` or ``cli``.
"""

# The daemon's processes run one thread each, as DataLoader runs its workers (torch's threads set
# to 1): one worker per core already. Read by the BLAS and OpenMP runtimes when they load, so set
# in the daemon's environment as it is launched (cli.daemonlaunch; master.daemon for `start
# --foreground`), before numpy is imported anywhere. Without it, the BLAS under numpy starts a
# thread per core in every process, each spinning ~0.1 s of CPU at import: a worker server, a
# daemon, a user's pipeline module that uses torch would each pay it, and the trainer's cores
# with them. Declared here, where importing it costs nothing.
ONE_THREAD_PER_PROCESS = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
