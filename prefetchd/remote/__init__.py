"""--executor ray: batches made on a Ray cluster (docs/scale-out.md).

``raybridge`` (the process that stands in for local workers), ``raycluster`` (joining or starting
a cluster, checking its nodes), ``rayaddress`` (which cluster an address names, and whose it is),
``raytask`` (what runs on the cluster), ``rayresults`` (results read as bytes, never unpickled).
A wing of the worker side: it never reaches the master.
"""
