"""prefetchd against torch.utils.data.DataLoader: ``prefetchd bench`` or ``python -m prefetchd.bench``.

One module per measurement (throughput, trainers, coldstart, restart, clientcost, ray_executor,
sources); the harness they share (common, run, consumer); the peers (dataloader, and dali, run
in a process of its own); the report apart (speedrows and waitrows make the table's rows, report
prints it and writes bench.json, bench.md and the timeline PNG); cli is the entry point. The
daemon never imports this package, and torch is imported only once cli has checked it imports.
"""
