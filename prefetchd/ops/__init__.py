"""What operators see: ``status`` (a job's state), ``stalls`` (trainer-wait accounting),
``metrics`` with ``metrics_http`` and ``scrapes`` (Prometheus), ``sdnotify`` (systemd).
Imported by the master; imports only the shared vocabulary at the top of the package.
"""
