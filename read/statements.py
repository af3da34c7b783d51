"""Named statements several modules of read/ run, below all of them (this module
imports nothing): :mod:`.queries` re-exports them. Each is a ``str.format`` template:
``{lifecycle}``, ``{transitions}`` the tables, ``{where}``/``{also}`` the conditions
its caller narrows it with.
"""

#: A cluster's worker removals: each one's stimulus (which the transitions of the tasks
#: it released name) and the worker removed; ``{also}`` adds conditions (`` AND ...``).
WORKER_REMOVALS = ("SELECT stimulus_id, worker FROM {lifecycle} WHERE cluster_id = {{c:String}} "
                   "AND action = 'worker_removed'{also}")

#: The scheduler's transitions of tasks out of processing by the stimuli ``stimuli`` (a
#: worker's removal names its own): per cluster, stimulus and task, the task's prefix,
#: group and span, where it went and when (float seconds), in that order; ``{where}``:
#: ``WHERE`` the clusters (and spans).
TAKEN_OUT_OF_PROCESSING = (
    "SELECT cluster_id, stimulus_id, key, any(prefix), any(task_group), any(span_id), "
    "any(finish), toFloat64(min(ts)) FROM {transitions} {where} AND source = 'scheduler' "
    "AND start = 'processing' AND stimulus_id IN {{stimuli:Array(String)}} "
    "GROUP BY cluster_id, stimulus_id, key ORDER BY min(ts), key")

#: When the tasks ``keys`` entered processing: cluster, key and time (float seconds),
#: in time order; ``{where}``: ``WHERE`` the clusters (and spans).
ENTERED_PROCESSING = ("SELECT cluster_id, key, toFloat64(ts) FROM {transitions} {where} "
                      "AND source = 'scheduler' AND finish = 'processing' "
                      "AND key IN {{keys:Array(String)}} ORDER BY ts")

#: A cluster's lifecycle (the scheduler's start and close, workers added and removed,
#: restarts, ...) in time order: when (float seconds), what, the worker, the client, the
#: reason, the stimulus and the detail (JSON text); ``{also}`` adds conditions
#: (`` AND ...``).
LIFECYCLE = ("SELECT toFloat64(ts), action, worker, client, reason, stimulus_id, detail "
             "FROM {lifecycle} WHERE cluster_id = {{c:String}}{also} ORDER BY ts")

#: The scheduler's transitions into erred (``{where}``: ``WHERE`` the clusters, spans,
#: keys or exceptions), as they happened: cluster, key, prefix, worker, when (float
#: seconds, and whole microseconds) and the exception.
ERRED = ("SELECT cluster_id, key, prefix, worker, toFloat64(ts), "
         "toInt64(toUnixTimestamp64Micro(ts)), exception FROM {transitions} {where} "
         "AND source = 'scheduler' AND finish = 'erred' ORDER BY ts, seq, idx")
