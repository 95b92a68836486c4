"""lmms-eval task definitions as evaluations: one vertical slice beside ``harness``.

    requests  the request table: plain columns (the chat as JSON, the images as PNG bytes), and
              the layout of a task's metrics in the rows a worker scores
    render    the driver's half: lmms-eval tasks rendered into request tables while planning
    scoring   generated texts -> lmms-eval's filters and ``process_results`` -> per-document
              float rows (the worker's half of the numbers)
    task      the worker's half: the ``lmms_eval`` task, generating through the backend's
              ``generate_images``

Why its own package and not inside ``harness``: lmms-eval is a fork of lm-eval whose task API
differs where it matters here (chat messages instead of contexts, ``doc_to_visual``, images,
generation only, its own module tree ``lmms_eval.*``); what the two share is taken from
``harness`` rather than written twice: the naming grammar (``config.names``), the request
tables in the store and the task objects sent through Ray (``harness.store``), and the
task pickling and config digest helpers (``harness.render``). It stands on harness's floor.

``core``'s task registry names the ``lmms_eval`` task lazily, so ``core`` never imports this
package. Importing this package imports neither lmms-eval nor torch.
"""
