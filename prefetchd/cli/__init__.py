"""The ``prefetchd`` command: ``app`` (the commands), ``launch`` (starting and stopping a
daemon), ``statusview`` (status on a terminal), ``terminal`` (its consoles), ``demo`` with
``datagen``, ``verify`` and ``pack``. Nothing below imports this folder.
"""
