"""Span trees rebuilt from scheduler transitions, with the semantics of
``distributed.spans`` and ``distributed.scheduler.TaskGroup``.

What Dask does, and how it is reproduced here from the wire events:

- A task is created in state ``released`` and counted in its TaskGroup's ``states``;
  every call of the ``TaskState.state`` setter moves one count from the old state to
  the new one, and the SchedulerPlugin sees each as one transition ``start ->
  finish`` (``start == finish`` means nothing moved, e.g. a task finished on a worker
  that has since left). Here a task is *created* at its key's first transition (one
  count in ``start``, which is ``released`` for a task seen from its birth), and each
  transition with ``start != finish`` moves one count.
- A TaskGroup belongs to the span it was first attached to (``TaskGroup.span_id``,
  carried by every transition); all its tasks count there, even those counted before
  the attachment. When the last task of a group is forgotten, Dask drops the group
  and a later task of the same name starts a new group; the same happens here, per
  cluster, through a registry of live keys -> (group, nbytes). The registry is also
  what attributes a ``forgotten`` transition, which carries no group on the wire.
- ``processing -> memory`` adds each startstop's duration, rounded to whole
  microseconds (``TaskGroup.add_duration``), to ``all_durations[action]`` and
  ``duration``; ``compute`` startstops move the group's ``start`` (earliest) and
  ``stop`` (latest). ``nbytes_total`` grows by the change of the task's ``nbytes``
  (``TaskState.set_nbytes``; a forgotten task's bytes stay counted).
- ``cumulative_worker_metrics`` sums the WORKER_DIGESTS rows that carry the span id,
  keyed like Dask's with the span id removed.

A span's snapshot is the roll-up of its tree (itself and all descendants), like
``Span``'s properties. ``done`` is true when no task of the tree is ``waiting``,
``no-worker``, ``queued`` or ``processing`` (``TaskGroup.done`` for every group).
``start`` is the earliest compute start of the tree (0 if none), raised to
``enqueued``. ``stop`` is the latest compute stop of the tree, raised to
``enqueued``: for a done span this is exactly Dask's ``Span.stop``; while a span is
not done Dask reports the current time instead, and the snapshot still carries the
latest stop seen (check ``done``).

``nthreads_intervals`` and ``active_cpu_seconds`` are Dask's, computed from the
cluster's copy of ``Scheduler.total_nthreads_history`` (LIFECYCLE ``total_nthreads``;
scheduler_start carries the whole history and replaces it, later events append):
Dask's span starts at the last history entry recorded before it was enqueued (here:
the last entry at or before ``enqueued``), and the intervals cover ``enqueued ..
stop`` with ``stop`` as above (for a span not done yet: the latest stop seen, where
Dask would use the current time). ``cumulative_worker_metrics`` then carries Dask's
derived ``("execute", "N/A", "idle or other spans", "seconds")`` entry,
``max(0, active_cpu_seconds - known execute seconds of the tree)``. Until the
cluster's history is known (a producer without ``total_nthreads``), the intervals
are empty, ``active_cpu_seconds`` is 0 and the derived entry is left out. A history
entry changes the snapshot (and version) of every span whose interval it falls in.

Input is checked before it changes anything: an event with a field of the wrong
type, a startstop whose duration does not fit in whole microseconds, or a span that
would be its own ancestor (a self-parent, two spans each other's parent) raises
:class:`Rejected` naming the field, and the tree is left as it was. The tree never
holds a span cycle, also after :meth:`SpanTree.load` (which cuts any it finds and
reports them).

Not seen by a scheduler plugin, hence not counted: data scattered to the cluster
(``Scheduler.update_data`` sets states without a transition).
"""

@@BODY@@
