"""The single-controller programming model (HybridFlow's hierarchical API), knowing no RL.

`Worker` classes with `@register`ed methods run in worker processes; a `WorkerGroup` calls a
method on every rank and returns a `DataFuture` at once; the method's transfer protocol
(`protocols`) splits its arguments over the ranks of a `ParallelLayout` and collects the
results. Batches travel as `DistBatch` plans over stored objects, so the driver holds refs and
row ranges, never tensors. `JobContext` is the cluster as a driver script sees it.

    worker.py     Worker, @register, what a worker process hosts
    group.py      WorkerGroup, DataFuture, gather: calls on a group of ranks
    protocols.py  transfer protocols (ONE_TO_ALL, DP_PROTO, 3D_PROTO, ...)
    parallel.py   ParallelLayout: the (pp, dp, tp) mesh and generation layouts
    batch.py      Batch: tensors and lists with the same rows
    distbatch.py  DistBatch, materialize/publish, RefTracker
    transfer.py   batches nested in call arguments and results
    context.py    JobContext, local_cluster
    config.py     the launch sections (worker, job; cluster and objectstore from below)
    schema.py     typed configs: checks, unknown keys, error paragraphs, the schema registry
"""
