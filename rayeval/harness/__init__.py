"""lm-evaluation-harness as one vertical slice, between ``core`` and ``plan``.

    names     the naming grammar of lm-eval results (``metric,filter``, ``NAME/TASK``), once
    requests  the request table: plain columns, the JSON of each document's requests, and the
              layout of a task's metrics in the rows a worker scores
    render    the driver's half: lm-eval tasks rendered into request tables while planning
    groups    which members' metrics an lm-eval group's aggregate averages
    store     request tables in the result store, checked against the driver's bytes before a
              run reads them, and the task objects sent to the workers through Ray
    task      the worker's half: the ``lm_eval`` task and its four sum-state metrics

``core``'s task registry names the ``lm_eval`` task lazily (``"rayeval.harness.task:Harness"``),
so ``core`` never imports this package and any process finds the task by name. Importing this
package imports neither lm-eval nor torch.
"""
