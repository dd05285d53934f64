"""The daemon: one job's master process and what it owns.

``daemon`` (the process's entry), ``startup`` (everything a job needs before it serves),
``loop`` (the master loop), ``pool`` (the workers), ``buffer`` with ``scheduler`` and ``retire``
(the window of batches), ``policy`` (decisions, the clock passed in), ``job`` (config + index +
plan), ``jobdir`` (the job folder), ``intake`` and ``progress_watch`` (the trainers' positions).
"""
