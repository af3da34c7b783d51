"""What the producers cost a busy scheduler, in four shapes, A/B in ABBA/BAAB quads.

FINDINGS, thirteenth pass (2026-11-26, session 19): the helper's collector

- The helper collected ~4,400 times per million events: what it allocates per
  event is acyclic and short-lived, and at CPython's thresholds (700, 10, 10) its
  collector was a third to half of its interpreter time. It now freezes what it
  made while starting and collects at (20,000, 20, 20)
  (``producers.relay.HELPER_GC_THRESHOLDS``): ``relay_replay.py collector`` 2,905
  -> 1,842 ns an event, collections 709 / 64 / 5 -> 11 / 0 / 0; ``relay_replay.py
  replay`` helper 0.93 -> 0.74 s on a 32k capture (4 runs a side; see its FINDINGS).
- All three shapes in one invocation, 4 quads each (``nice -n 5 python
  bench/scheduler_overhead.py --quads 4 --shapes 200k,32k,fresh40k``, 48 runs,
  6870984's code; 1 invocation, so the figures are one sample of this machine's
  hour):

  | shape | wall per quad -> median | CPU per quad -> median | order-balanced wall / CPU |
  |---|---|---|---|
  | 200k | 1.040, 1.008, 1.007, 1.049 -> **1.024** | 1.029, 1.005, 1.008, 1.061 -> **1.018** | 1.026 / 1.025 |
  | 32k | 0.970, 1.004, 1.079, 0.981 -> **0.993** | 0.936, 1.042, 1.066, 0.984 -> **1.013** | 1.008 / 1.007 |
  | fresh40k | 0.998, 1.003, 1.003, 0.980 -> **1.000** | 1.014, 1.014, 1.011, 0.942 -> **1.013** | 0.996 / 0.995 |

  Targets (wall <= 1.03, CPU <= 1.05) met on each; the aims (1.02 / 1.03) on each
  but 200k's wall (1.024).
- 200k per thread, medians of 8 runs a side, B - A (session 18 in brackets): event
  loop +1.82 s (+3.47), Dask-Offload -0.26 s (+1.33), relay thread 0.26 s (0.29),
  whole process +2.46 s (+4.96) on 62.94 s; helper **3.92 s (5.13)**; workers
  +2.96 s (+9.11); broker 0.41 s; GC +0.19 s, gen-0 +18, gen-1 +0, gen-2 4 / 4;
  event loop preempted +827 (+1,087). 32k: whole process -0.01 s, helper 0.72 s;
  fresh40k: whole process +0.16 s, helper 0.83 s, workers -1.09 s.
- noop100k after it, 2 quads (``--quads 2 --shapes noop100k``, 8 runs of ~165 s):
  throughput with/without 1.033, 0.987 -> **1.010** (602 / 610 tasks/s, medians of
  runs), wall 0.968, 1.013 -> 0.991, CPU 0.895, 1.026 -> 0.960; process -0.83 s,
  relay 0.15 s, helper 1.96 s (3.41 in session 14). Two quads, not four.
- This hour the machine ran 200k's runs in 131-155 s of wall (its CPU 58-70 s a
  run): slower than session 18's, so less of the run's time was contended. A quad
  in four still lands 4-6 % off the others (200k quad 4, 32k quad 3): the medians
  are under the targets with that noise in them, not beyond it.

FINDINGS, twelfth pass (2026-11-26, session 18): every transition without an error written as bytes

- What the eleventh pass named, built: the compiled hook (``producers/_hotpath.c``)
  writes every transition without an error, processing->memory included (worker,
  nbytes, typename, startstops read from the call's keywords), as a row in
  ``marshal``'s format to a ``Tape``, and only the task's group to the buffer; the
  relay hands a frame's rows over as one bytes object and names the groups with a
  C-level lookup. No Python object is created or held per transition.
- Counts, one run each (``transition_hotpath.py --callgrind``): hook 2,799 -> 111
  instructions a transition (a no-op Python plugin's call costs more: it builds
  the kwargs dict), the relay's hand-over 5,348 -> 1,925 an event, the scheduler
  process per event with the helper 8,140 -> 2,037. ``gc_pressure.py`` (2 runs a
  side): young collections added by the producers 252 -> 0 (A 1, B 0).
  ``scheduler_instructions.py`` (1 run, first tape version): the event loop's
  instructions B / A 1.010 (+1,987 a transition, the graph hook and everything
  else included); the functions that differ most are the hook's own (put_str,
  put_row, hook_vectorcall) and CPython's collector, with fewer instructions in B.
- 200k, 4 quads (``nice -n 5 python bench/scheduler_overhead.py --quads 4 --shapes
  200k``, 16 runs, 13be339's code plus the tape's shared strings):
  wall 1.069, 1.041, 1.147, 1.011 -> **1.055**; CPU 1.085, 1.023, 1.194, 1.008 ->
  **1.054** (order-balanced: ABBA quads 1.140, BAAB 1.015). Per thread, medians of
  8 runs a side: event loop +3.47 s, Dask-Offload +1.33 s, relay thread **0.29 s**
  (was 1.2-1.8 s), whole process +4.96 s (68.88 -> 73.85); GC **+0.26 s**, gen-0
  +19 (was +72 to +304), gen-1 +0, gen-2 4 / 4; helper 5.13 s; workers +9.11 s.
  A runs alone spanned 62.9-76.6 s within one quad (quad 3). Not met.
- Where the rest goes is no longer instructions in the scheduler process: its
  event loop executes ~1 % more instructions, its relay thread 0.3 s, yet the
  event loop's CPU is +3.5 s and Dask-Offload's (which runs none of our code)
  +1.3 s, with ~1,100 more involuntary context switches (11,596 -> 12,683) and
  full collections ~5 % slower in B. On 2 cores shared with 2 workers, the
  workers' own recording (+9.1 s), the helper (5.1 s) and the broker (0.5 s) run
  beside the scheduler: what is left looks like contention for the cores and their
  caches, which instruction counts cannot see. Next: the workers' recording (their
  transitions, the same tape), the helper's decode (its rows' keys and stimulus
  ids are new objects), and a control run that burns the same CPU beside A
  (``--control-burn``) to size the contention itself.
- 32k and fresh40k on the same tree (``nice -n 5 python bench/scheduler_overhead.py
  --quads 4 --shapes 32k,fresh40k``; fresh40k stopped after 3 quads for time):
  32k wall 1.026, 1.156, 0.998, 0.972 -> median 1.012, CPU 1.002, 1.222, 0.988,
  0.975 -> 0.995; fresh40k wall 0.983, 0.991, 1.036, CPU 0.953, 0.983, 1.094 (3
  quads: below the 4 the issue asks). One quad in four of each is 9-22 % off the
  others: the noise of this machine, not a result.

FINDINGS, eleventh pass (2026-11-26, session 17): the plain transitions, removed; then in C

- An experiment (not kept in the tree): the hook returned at once for every
  transition without Dask's kwargs (4 in 5; a line at the top of
  ``BlackboxSchedulerPlugin.transition`` gated by an environment variable), so
  they cost nothing in the Dask process, the helper or the broker. ``nice -n 5
  python bench/scheduler_overhead.py --quads 2 --shapes 200k`` with it: CPU
  1.052, 1.072 -> **1.062**, wall 1.030, 1.045 -> **1.038**; B - A: event loop
  +3.28 s, relay thread 1.21 s, GC +1.47 s (gen-0 +304, gen-1 +10, gen-2 4 / 4:
  the same extra collections as a whole recording), helper 1.68 s. So the plain
  transitions are not what keeps 200k above the targets: what is left without
  them is the ~200k processing->memory transitions with Dask's kwargs (each held
  until the hand-over as a tuple, the hook's kwargs dict and Dask's startstops
  list: the extra young collections; their rows: most of the relay thread's
  1.2 s), the graph hook, metrics and the helper beside Dask.
- Built anyway, since the count says it is half the hook: the plain case in C
  (``producers/_hotpath.c``, ``producer.compiled-hook``): 4,318 -> 2,206
  instructions added a transition (``transition_hotpath.py --callgrind``).
- 200k, 2 quads a side, back to back, the compiled hook then the Python hook
  (``DASK_BLACKBOX__PRODUCER__COMPILED_HOOK=false``, ``--first baab``):
  | 200k, 2 quads a side | compiled hook | Python hook |
  |---|---|---|
  | CPU ratio per quad | 1.078, 1.096 -> **1.087** | 1.039, 1.026 -> **1.032** |
  | wall ratio per quad | 1.042, 1.058 -> **1.050** | 1.020, 1.008 -> **1.014** |
  | event loop B - A | +2.88 s | +2.07 s |
  | relay thread | 1.78 s | 1.65 s |
  | GC B - A (gen-0 / gen-1 extra) | +0.89 s (+296 / +9) | +0.67 s (+294 / +9) |
  | helper / broker | 4.05 / 0.41 s | 3.93 / 0.38 s |
  | A runs' scheduler CPU | 57.8-61.4 s | 59.8-67.9 s |
  | B runs' scheduler CPU | 63.8-67.1 s | 62.2-66.7 s |
  The Python side met the targets by these two quads, the compiled side did not;
  the Python side's A runs alone span 59.8-67.9 s (one at 67.9 s lowers its
  second quad), and the Python hook's tree measured 1.07-1.09 in sessions 14-16.
  Noise, both ways: no difference between the two hooks this machine resolves,
  and no resolution of #15 from one lucky hour.
- Then the hook took worker, nbytes, typename and startstops out of Dask's kwargs
  instead of holding the dict (``gc_pressure.py``: 993 / 90 -> 252 / 22 young /
  middle collections). 200k, 2 quads (a slower hour: A runs 64.6-69.1 s; one B
  run at 80.9 s): CPU 1.138, 1.049 -> 1.094, wall 1.122, 1.029 -> 1.076; the
  extra collections of a real run **gen-0 +72, gen-1 +3** (were +294-304, +9-10),
  GC B - A +0.48 s (was +0.67-1.47), event loop +2.02 s, relay thread 1.62 s.
  The counts moved as the bench said; the ratio, again, says nothing this hour.

FINDINGS, tenth pass (2026-11-25, session 16): transitions as runs of columns

- The step the ninth pass named, built (``dask_blackbox.contract.TRANSITION_RUN``):
  consecutive transitions travel as one event of columns (key, time, start,
  finish, stimulus id, each distinct [prefix, group, span_id] once, Dask's kwargs
  as columns left out where all None), one orjson call per run, and both readers
  expand it (``contract.expand_events``) to the same events, indexes and rows.
  Schema 2; version 1 is still read.
- The helper on a fixed input (``relay_replay.py``, fresh40k capture, 4 runs a
  side): 1.69 -> 1.17 s (0.694). In the 200k runs below: 6.73 -> 4.19 s a run
  (medians of 4 B runs), its sender thread about halved; broker 0.44 -> 0.42 s.
- The scheduler did not follow, by what this machine resolves. ``nice -n 5
  python bench/scheduler_overhead.py --quads 2 --shapes 200k`` on the new tree,
  then the same with ``--first baab`` on 2f3cc51 (checked out), back to back:
  | 200k, 2 quads a side | new (cbecc00) | before (2f3cc51) |
  |---|---|---|
  | CPU ratio per quad | 1.094, 1.090 -> **1.092** | 1.053, 1.094 -> **1.074** |
  | wall ratio per quad | 1.051, 1.053 -> **1.052** | 1.024, 1.054 -> **1.039** |
  | event loop B - A | +3.50 s | +2.18 s |
  | relay thread | 1.81 s | 1.80 s |
  | whole process B - A | +5.72 s (A 61.77) | +4.06 s (A 62.80) |
  | helper / broker | 4.19 / 0.42 s | 6.73 / 0.44 s |
  | workers B - A | +3.22 s | +0.85 s |
  The Dask process runs the same code on both sides (the hot path, the relay
  thread, the frames: 1.81 against 1.80 s); the ninth pass's experiment
  predicts ~0.9 points from a 2.5 s smaller helper, and one quad of either side
  spans 1.053-1.094. Not a gain the scheduler's ratio shows; what it did cut is
  the helper's CPU and the bytes on the wire.
- So the targets are not met at 200k with either tree (1.07-1.09 CPU). What the
  ninth pass says of the Dask process's own half (relay thread ~1.8 s, event loop
  +2-3.5 s, garbage collection +1.1-1.3 s) is what is left to cut.

FINDINGS, ninth pass (2026-11-25, session 15): what the helper's work costs, by removing it

- The experiment (not kept in the tree): the helper takes each frame off its pipe,
  decodes it and counts its items delivered at once, encoding and sending nothing;
  the Dask process is unchanged (hot path, relay thread, frames, pipe, status).
  The patch: in ``_Receiver.apply``, right after the frame is unpacked, gated by
  an environment variable the helper inherits (read once, at the helper's import
  of ``producers.relay``, into ``_DISCARD``)::

      if _DISCARD:
          self.skipped += len(names) + len(others)
          self.transport.sent_events += len(names) + len(others)
          return

  Each shape run twice in the same hour, ``nice -n 5 python
  bench/scheduler_overhead.py --quads Q --shapes S``, with the variable set
  ("discard") and without ("normal", ``--first baab``).
- 200k, 2 quads a side (8 runs of 128-134 s each):
  | | discard | normal |
  |---|---|---|
  | CPU ratio per quad | 1.052, 1.036 -> **1.044** | 1.057, 1.081 -> **1.069** |
  | wall ratio per quad | 1.016, 1.001 -> **1.009** | 1.029, 1.055 -> **1.042** |
  | event loop B - A | +1.47 s | +2.47 s |
  | relay thread | 1.54 s | 1.54 s |
  | whole process B - A | +2.72 s (on 58.21) | +4.13 s (on 56.75) |
  | helper | 0.79 s | 5.87 s |
  | broker | 0.08 s | 0.39 s |
  | workers B - A | -2.07 s | +3.67 s |
  | event loop preempted B - A | +984 | +1,745 |
  The relay thread costs the same in both (1.54 s): the Dask process's own work is
  the same. The helper's ~5.1 s of encoding and delivery (and the broker's 0.3 s)
  cost the scheduler ~1 s more of event loop and 2.5 points of CPU ratio, 3.3 of
  wall. Without them 200k is within the targets (CPU 1.044 <= 1.05, wall 1.009 <=
  1.03, by 2 quads), not the aim (1.03): the Dask process's own part is ~4.4 %.
- fresh40k, 2 quads a side: discard CPU 1.116, 1.021 -> 1.069, wall 1.024, 1.002
  -> 1.013 (process +1.15 s on 22.11: event loop +0.82, relay 0.36; helper 0.28 s);
  normal (helper at 19; the first measurement of this shape at 19) CPU 1.078,
  1.022 -> **1.050**, wall 1.018, 1.005 -> **1.012** (process +1.49 s on 21.51:
  event loop +1.19, relay 0.35; helper 1.14 s, broker 0.14 s, workers +2.23 s).
  Here the helper is small (1.14 s a run, 4.2-4.5 s in session 7) and the two
  sides do not differ beyond the noise: one quad alone spans 1.02-1.12.
- fresh40k, normal, 2 more quads after the rest (``--quads 2 --shapes fresh40k``):
  CPU 1.149, 1.036, wall 1.035, 1.007 (helper 1.19 s, process +1.42 s on 21.98).
  The 4 quads at niceness 19: CPU 1.078, 1.022, 1.149, 1.036 -> **1.057** (not
  met), wall 1.018, 1.005, 1.035, 1.007 -> **1.012** (met).
- 32k, discard, 4 quads (16 runs): CPU 1.075, 1.006, 0.984, 1.097 -> **1.041**;
  wall 1.057, 0.966, 0.994, 1.044 -> **1.019** (process +0.24 s on 9.12: event
  loop +0.31, relay 0.23; helper 0.31 s). The normal side was not run this hour
  (session 14, helper at 19: 1.088 / 1.054); hours differ by more than that.
- So: where the helper's CPU is large (200k: ~6 s a run), removing its work moves
  the scheduler's ratio by ~2.5 points, and what is left is the Dask process's own
  work: 200k's +2.72 s, 4.4 % (relay thread 1.54 s: marshal of the records' fields
  and the per-item loop, ~1.5 us an event; event loop +1.47 s: the hook, ~1 us a
  transition, and the collections the hand-over's lists cause, gen-0 +308 a run).
  Both halves must shrink for the aim (1.03); for the targets, the helper's half.
- Where the helper's 6.4 us an event goes (``relay_replay.py replay --sides new
  --runs 1 --speed 2 --spy DIR`` on a fresh40k capture, 1 run, 394 samples, by
  own line): the records' JSON (``encode_row``) ~20 %, the selector's waits 14 %,
  zstd 9 %, aiokafka building the batch 12 %, the frame's decode 5 %, the rest
  the packing loop and the plumbing, each a few percent.
- Tried and dropped: the helper encoding all of a frame's records at once
  (``TransitionJSON.encode_rows``: slices of the flat fields, ``map`` of the
  caches' ``get`` and ``orjson.dumps``, ``zip`` and ``b"".join`` per record, in C;
  the items put in the buffer ready-built through ``zip``; ``ready`` an
  ``itemgetter``), the same bytes as ``encode_row`` (tested on str, tuple,
  non-ASCII and int keys, cache clears, None names and stimulus ids, float edge
  cases): 0.92 -> 0.63 us a record alone (7 reps, best), but the helper as a
  whole did not move: ``relay_replay.py replay --base e184845 --runs 4 --speed
  2``: 1.50 s (base) against 1.53 s (new), medians of 4 runs a side; the work
  moved from the sender thread (0.84-0.94 -> 0.58-0.61 s) to the reading thread
  (0.50-0.57 -> 0.83-0.91 s). Per-event Python spread over many places is not
  cut by one faster piece.
- Next, structurally (the helper's half): the helper's work per event is the
  contract's JSON, one event at a time, then zstd and aiokafka over its bytes.
  Shipping the relay's frames as compact batches (a key-text table, the states as
  small codes, the stimulus ids and times as columns, the groups' names once per
  frame) and expanding them to the contract's events off the Dask machine would
  leave the helper a decode, the key texts (cached), one orjson call per column
  and a produce request per frame. Two shapes: a compact event kind that
  ``dask_blackbox.contract`` expands for both readers (processors' ``envelopes``
  and the sink's typed decoder; ``SCHEMA_VERSION`` 2, as a reader that ignores an
  unknown field would lose events), or a topic of compact frames that an expander
  agent in the faust app republishes as JSON envelopes to the raw topic (the
  contract and readers unchanged; a second hop, and ``seq`` numbering across the
  split of a frame into envelopes). The Dask process's half stays as it is:
  relay 1.54 s, hook ~1 s at 200k.

FINDINGS, eighth pass (2026-11-25, session 14): the helper at niceness 19

- The helper adds ``producer.helper-niceness`` (19 by default, was a fixed +5) to
  the scheduler's niceness; the relay and status threads keep the scheduler's (they
  take its GIL). At 19 the helper's CFS weight is 15 against Dask's 1024 (110
  against 335 under this bench's ``nice -n 5``, 15 against 335 now): on a machine
  Dask fills it runs mostly on CPU Dask leaves idle. Its input pipe is 1 MiB
  (``F_SETPIPE_SZ``): frames it has not read wait in the kernel, not in the relay
  thread's write, and survive a killed scheduler. It did not fall behind: B
  delivered everything it had accepted 0.49-1.02 s (median 0.87, 8 runs) after
  the graph was forgotten (about the relay's linger; the new "delivered after"
  column). This bench does not count drops.
- 200k, 4 quads (16 runs of 132-149 s): CPU 1.081, 1.062, 1.079, 1.104 -> median
  **1.080** (session 13: 1.084); wall 1.056, 1.034, 1.057, 1.070 -> **1.056**
  (1.059). Per thread (medians, 8 runs a side): event loop 49.91 -> 53.02 (+3.11;
  was +4.66), relay 1.73 (2.03), process 61.55 -> 65.68 (+4.13; was +6.87),
  helper 6.40, broker 0.43, workers +2.80 s (was +12.27), event loop preempted
  +1,933 (was +3,678), GC +0.95 (was +1.31; gen-0 +296, gen-1 +9, gen-2 4 -> 4).
  What B adds to the process fell by 2.7 s, mostly Dask's own work no longer slowed
  beside the helper; the ratio moved less (1.084 -> 1.080) because this hour's A
  ran 3.3 s faster. Not an A/B of the niceness in one script: the sessions' hours
  differ.
- 32k, 4 quads: CPU 1.082, 1.094, 1.020, 1.131 -> **1.088**; wall 1.074, 1.051,
  1.034, 1.057 -> **1.054**. The same hour, before the change (helper at +5, 4
  quads): 1.100 (0.987, 1.295, 1.013, 1.187) / 1.076 (0.981, 1.189, 1.016,
  1.136). Per thread after: event loop 7.45 -> 7.94, relay 0.25, process +0.64 s
  (before: +1.08 s), helper 1.00 s, delivered 0.43 s after the graph was gone.
- noop100k, 2 quads (8 runs of ~155 s): throughput with/without 1.003, 0.968 ->
  **0.985** (633 / 643 tasks/s; session 13: 0.970); CPU 1.039, 1.068 -> 1.053;
  wall 0.997, 1.033 -> 1.015. Process +3.13 s, relay 0.73 s, helper 3.41 s,
  delivered 0.71 s after the graph was gone.
- fresh40k with the helper at +5 (before the change; 2 quads, stopped for the
  200k run): CPU 1.031, 1.114, wall 1.007, 1.033; the helper 1.08-1.29 s a run
  (4.2-4.5 s in session 7), relay thread 0.35-0.42 s.
- What remains at 200k (+4.13 s, 6.7 %): the relay thread 1.73 s and the hot path
  (~1 s: 4,331 instructions a transition, ``transition_hotpath.py --callgrind``)
  are the recording's own work in the process; GC +0.95 s; the rest the event
  loop's extra preemptions. Tried and dropped this pass: the relay's names of the
  records' groups looked up in C (``set``/``compress``/``map``): 5,996 -> 6,237
  instructions an event (callgrind, 1 run), as the sixth pass found for C
  iterators. marshal v4 stays (v2: 2.7x the encode, 3.5x the bytes; measured on
  the frames of a fresh40k run, 3 reps).

FINDINGS, seventh pass (2026-11-25, sessions 12-13): the collector's generations

- The change (commits 1d776d7, 68b2c65): the buffer keeps a ``transition_log``
  record's five fields (key, start, finish, stimulus_id, timestamp: the key exists
  already, the rest are strings and a float the collector does not track) instead
  of Dask's record (a tuple and its recommendations dict), and a transition with
  kwargs carries its record's timestamp instead of the record. Held for a linger,
  records had outlived young collections and been promoted to the oldest
  generation, whose growth triggers full collections. Hot path
  (``bench/transition_hotpath.py``, 9 rounds a run, one after the other): 0.84 us
  a call added before (1 run), 0.90, 0.92, 1.03 after (3 runs; 0.52 in session
  12's quieter hour). Counted (``transition_hotpath.py --callgrind``, 1 run a
  tree, 10,000 transitions): the hot path adds 3,169 instructions a transition
  before, 4,331 after (the 5-tuple of fields and the deque's ``extend``); the
  relay's hand-over 6,465 an event before, 7,408 after the change, 6,014 once the
  hand-over pops the buffer and the fields in C (``map(deque.popleft, ...)``
  instead of a comprehension: commit after 1acf9c8). Fewer collections were
  bought with ~1,160 more instructions a transition on the event loop.
- Counted without noise by ``bench/gc_pressure.py`` (a real ``Scheduler`` holding
  200k tasks, 1M transitions as Dask makes them, the relay's hand-over done every
  3,700 transitions; 2 runs a side, the same counts on each): before (d6976d0)
  gen-0 collections 2,732, gen-1 248, gen-2 4 (1.30 s) added; after 993, 90, 0;
  the drive's CPU 0.88 -> 3.56 s before, 0.93 -> 2.11 s after.
- 200k after it, 4 quads (16 runs of 135-162 s, ``--quads 4 --shapes 200k``): CPU
  1.111, 1.047, 1.148, 1.057 (median 1.084, was 1.102; order-balanced 1.090),
  wall 1.083, 1.024, 1.104, 1.035 (median 1.059, was 1.062; balanced 1.061): not
  met. Medians over 8 runs a side: event loop 52.81 -> 57.47 s (+4.66),
  Dask-Offload 11.50 / 11.59 s, relay thread 2.03 s, whole process 64.84 -> 71.71
  s (+6.87), helper 6.70 s, broker 0.49 s, workers 182.51 -> 194.78 s (+12.27),
  preempted 11,648 -> 15,326. GC 7.69 -> 9.00 s (+1.31, was +2.43): gen-0
  collections 3,506 -> 3,801 (+295, was +818), gen-1 113 -> 123 (+10, was +26),
  gen-2 4 -> 4 (was 4 -> 5); CPU in them +0.40 / +0.34 / +0.47 s. The extra full
  collection is gone; what remains is each collection taking longer in B (a full
  one ~1.27 s against ~1.15 s), as the rest of the scheduler's work does.
- 32k after it, 4 quads (16 runs, ``--quads 4 --shapes 32k``): CPU 0.987, 1.132,
  1.005, 1.247 (median 1.069, was 1.083; balanced 1.089), wall 0.984, 1.090, 0.988,
  1.180 (median 1.039, was 1.068; balanced 1.058): not met, and noisy (the BAAB
  quads 1.190, the ABBA 0.996). Medians over 8 runs a side: event loop 9.23 ->
  10.10 s, relay thread 0.33 s, process 10.80 -> 12.17 s, helper 1.23 s, broker
  0.09 s; GC 0.96 -> 0.97 s (was 0.71 -> 0.84; gen-0 collections +40, was +120).
- noop100k after it, 2 quads (8 runs of ~160 s, ``--quads 2 --shapes noop100k``):
  throughput with/without 0.966, 0.973 (median 0.970: 610 against 632 tasks/s;
  session 7, 1 quad: 0.909), CPU 1.048, 1.069 (median 1.058), wall 1.035, 1.028
  (median 1.031). Medians over 4 runs a side: event loop 61.02 -> 63.29 s, relay
  thread 0.87 s, process 61.47 -> 64.70 s, helper 4.03 s, broker 0.41 s, GC 2.35
  -> 2.63 s (gen-2 2 -> 2).
- Where 200k's +6.87 s goes now: the relay thread 2.03 s, the hot path ~0.5 s
  (1M calls), GC +1.31 s, and ~3 s of the event loop that is Dask's own work done
  slower: B runs are longer (workers +12.27 s of CPU on 2 cores that the helper,
  6.70 s, and the broker, 0.49 s, share with them), and a scheduler whose heap is
  hundreds of MB does the same work in more CPU seconds when other processes run
  on its cores (preempted +3,678; session 8's control burned 6 % of a core beside
  an unrecorded run and cost as much as recording). Both halves must shrink: the
  recording's own work in the process (relay, hot path, GC: ~3.8 s, 5.9 %) and
  what the machine spends beside it (helper and broker). Next, structurally: the
  helper's 6.7 us an event (decode, an event dict, orjson, compression, aiokafka)
  is per event in the interpreter;
  shipping the relay's frames to Kafka as they are (a compact, columnar batch: the
  flat record fields and their names) and expanding them to the wire contract's
  events in the stream processors, off the Dask machine, would cut the helper to
  about a copy and a produce request per frame; the relay thread (2 us an event,
  marshal of keys shared with the scheduler) would be what is left.

FINDINGS, sixth pass (2026-11-24/25, sessions 9-11): fewer preemptions, a hang, 200k

- SCHED_BATCH for the recording's threads (the relay and status threads, every
  thread of the helper; commit 3e1b507): waking up, none preempts a running thread
  of Dask's. 32k, 4 quads (16 runs): CPU 1.091, 1.092, 1.030, 1.083 (median 1.087),
  wall 1.072, 1.060, 1.029, 1.048 (median 1.054). Medians over runs: event loop
  10.42 -> 11.23 s, process 12.16 -> 13.22 s, helper 1.20 s, relay thread 0.29 s,
  event loop preempted 2,566 -> 3,004 times.
- After a hand-over of ``BUSY_ENVELOPE`` items or more the relay thread waits
  ``relay.LINGER`` (0.5 s) instead of flush-interval (commit fbbc46b): fewer
  wake-ups of a thread that takes the GIL from the event loop. 32k, 4 quads (16
  runs of 20-23 s, a faster machine): CPU 1.098, 1.078, 1.083, 1.083 (median
  1.083; order-balanced 1.085), wall 1.068, 1.055, 1.073, 1.068 (median 1.068;
  balanced 1.066). Medians over 8 runs a side: event loop 8.36 -> 8.54 s (+0.19),
  relay thread 0.34 s, Dask-Offload 1.38 / 1.36 s, whole process 9.88 -> 10.30 s
  (+0.42), helper 1.00 s, broker 0.10 s, workers 28.32 -> 29.62 s (+1.30),
  preempted 1,862 -> 2,223, GC 0.71 -> 0.84 s (gen-0 collections 552 -> 672). No
  better than without it; kept (fewer wake-ups, no loss).
- Where 32k's extra CPU goes now, per thread: the relay thread 0.34 s (3.4 % of
  the process) and the event loop +0.19 s (the hook: ~3,200 instructions a
  transition, 2 %) already exceed 5 % together; garbage collection +0.13 s. The
  medians over runs give +4.3 % for the process, the quads' sums +8 %: on 2 cores
  the workers fill the machine, and what the recording adds beside the scheduler
  (helper 1.0 s, broker 0.1 s) stretches the run, the workers' CPU with it.
- The 200k hang of session 5 was a bug, fixed (commit b60c0ff): the relay counted a
  whole hand-over taken before moving it out of the buffer, so ``accepted_events``
  read meanwhile counted up to 20,000 items twice, and a wait for their delivery
  (this bench's ``_wait_delivered``, the tests' wait) never ended. Seen again: target
  1,010,440, accepted and sent 1,002,230. Now the sender counts and takes under a
  lock only readers of ``accepted_events`` share.
- 200k also broke worker connections, in A and B runs alike (3 of ~12 runs): a
  worker kept from reading its connection by the flood of root tasks past the
  kernel's TCP_USER_TIMEOUT (``comm.timeouts.tcp``, 30 s),
  "worker-handle-scheduler-connection-broken". The 200k shape now runs with
  ``comm.timeouts.tcp: 600s``; a run that loses a worker process anyway raises
  ``WorkerLost`` and its quad is run again; ``BENCH_CLUSTER_LOGS=DIR`` keeps the
  clusters' logs.
- 200k, 4 quads (16 runs of 122-146 s, ``--quads 4 --shapes 200k``, 200,079 tasks,
  ~1.0M events a B run): CPU 1.097, 1.107, 1.120, 1.087 (median 1.102;
  order-balanced 1.103), wall 1.045, 1.069, 1.082, 1.055 (median 1.062; balanced
  1.063): not met. Medians over 8 runs a side: event loop 50.91 -> 54.26 s
  (+3.35), Dask-Offload 10.30 / 10.38 s, relay thread 2.34 s (3.5 % of the
  process), status thread 0.03 s, whole process 61.11 -> 67.18 s (+6.07), helper
  6.33 s, broker 0.54 s, workers 172.83 -> 175.45 s, preempted 10,176 -> 14,371,
  GC 6.16 -> 8.59 s (+2.43; gen-0 collections 3,498 -> 4,316, gen-1 113 -> 139,
  gen-2 4 -> 5).
- Garbage collection is the largest item of 200k's B - A: +2.43 s of the process's
  +6.07 s (runs: A 5.67-6.94 s, B 7.58-9.39 s, 3-5 full collections either side),
  then the relay thread (2.34 s) and the rest of the event loop (~+0.9 s, the
  hook's instructions ~0.5 s). 818 more young collections a run are ~570k more
  net allocations of tracked objects, ~3 a task. Dask keeps 1,000
  records in ``transition_log`` (``distributed.admin.low-level-log-length``); the
  buffer keeps every record (a tuple and its recommendations dict) until the next
  hand-over, up to ``LINGER`` later, about 4,000 transitions at 200k's rate, and the
  hook keeps a tuple and Dask's kwargs dict per transition with kwargs: more of
  them survive the young collections and are promoted, and the collections
  traverse them. Next: hand over on the records' count rather than a time under
  load (a record handed over before Dask would have dropped it), a kwargs
  transition buffered as Dask's record and its kwargs (no tuple), the relay's
  frame without a tuple per row; and measure GC per generation, A/B.

FINDINGS, fifth pass (2026-11-23, session 8): fewer requests, and a control

- The control settles what fresh40k's cost is: B attaching nothing, a process busy
  6 % of the time beside it instead (``--control-burn 0.06``, one burst per
  100 ms, niceness +5 like the helper's; 1 quad): CPU ratio 1.124, wall 1.094, as
  much as the producers' 1.127 / 1.084 (session 7, 2 quads). On this shape the
  scheduler is not saturated and the two workers fill the machine: any CPU added
  beside Dask lengthens the run, and the scheduler's CPU follows its wall time. So
  what to cut is what recording adds to the machine outside the scheduler's own
  work: the helper (4.2-4.5 s a run) and the broker (0.9 s).
- Where the helper's CPU went: ``bench/relay_replay.py`` replays the frames of a
  real fresh40k run into a helper (see its FINDINGS). One envelope per frame, 1,200
  requests a run, each ~0.5 ms of aiokafka's Python in the helper and a produce
  request for the broker.
- The change: after a busy envelope (``transport.BUSY_ENVELOPE`` = 200 events or
  more) the helper lingers ``relay.LINGER`` = 0.5 s instead of ``flush-interval``
  before its next partial envelope; after an idle spell the first items leave at
  once, as before (a light load, such as ``bench/freshness.py``'s, never makes a
  busy envelope). Replayed: 1,270 -> 357 envelopes, helper 4.11 -> 3.39 s, broker
  0.59 -> 0.21 s. In real fresh40k runs (8 + 8 runs, 4 quads): helper 1.9-2.9 s,
  broker 0.22-0.28 s, relay thread 0.67-1.10 s, status thread 0.01-0.02 s (it
  reads a line per change, and there are fewer changes).
- fresh40k with the change, 4 quads (16 runs of 75-122 s; the machine drifted up
  to 40 % within a quad): CPU ratios 0.958, 1.277, 1.107, 0.967 (median 1.037),
  wall 0.959, 1.152, 1.091, 0.959 (median 1.025): under the targets (1.05 / 1.03)
  by the median, but the order-balanced figures are 1.076 / 1.040 and one quad
  alone spans 0.96-1.28. Medians over runs, per thread (two batches of 2 quads):
  scheduler process A 40.90 / 49.45 s, B 43.54 / 51.55 s (+6.5 % / +4.2 %), of
  which the relay thread 0.82 / 0.95 s and the event loop +1.30 / +1.32 s; helper
  2.31 / 2.63 s; broker 0.26 / 0.28 s; workers +1.14 / +0.91 s.
- 32k with the change, 2 quads (runs 34-55 s; quad 1's two A runs took 55 and 34 s):
  CPU 1.059, 1.111 (median 1.085), wall 1.024, 1.074 (median 1.049), against
  session 7's 4 quads at 0.962 / 0.956 before it. Medians over 4 runs a side: helper
  1.80 s (2.72 in session 7), broker 0.13 s (0.36), relay thread 0.52 s (0.72),
  status thread 0.01 s (0.06); event loop B - A +3.40 s on 14.5 s. Two more quads
  an hour later, on a faster machine (27-36 s runs): CPU 0.983, 1.334, wall 0.985,
  1.279; in the second (B A A B) both B runs took 35.8 s against 27.4 and 28.6 s
  for A, so that quad's cost is not drift. All 4 quads: CPU median 1.085, wall
  1.049: 32k is not met after the change, though the producers' own threads and
  processes cost less than in session 7 on every line (second pair: relay 0.40 s,
  helper 1.39 s, broker 0.10 s a run; event loop B - A +1.47 s on 11.8 s).
- Next: the relay thread (2 % of the scheduler process) could hand over less often
  under load in the same way (fewer GIL grabs from the event loop, fewer frames
  for the helper); the helper's remaining CPU is mostly per event in the
  interpreter (decode, rows, JSON: ~1.5 s of its ~2.5 s).

FINDINGS, fourth pass (2026-11-23, session 7): the run's position, the machine

- What else runs: each run now also reports the workers', the client's and the
  broker's CPU, the event loop's context switches and the run's garbage
  collection. On 32k the two workers use ~1.3 cores for the whole run (CPU in
  proportion to wall: 59-91 s for 46-70 s runs): with the scheduler's ~0.5 core
  the 2-core machine is full without the producers, so whatever B adds (helper
  2.2-3.6 s, relay thread 0.6-1.0 s, broker 0.3-0.6 s a run) competes with it.
- A run's position in its cluster's sequence costs more than the producers:
  with the smaller warm-up graph of the earlier passes, ABBA quads came out above
  BAAB quads in all 7 pairs measured since session 5 (1.100/1.047, 1.243/1.035,
  1.148/1.047, 1.410/1.103, 1.174/0.946, 1.203/1.055, 1.237/0.965). The first big
  graph on a cluster grows its heap, and a full collection (0.4-1.0 s on that
  heap) fell by chance of promotion counts: in ABBA quads B had one (gen 2 at
  +2-3.3 s, during graph materialization, and +6.6 s in the next run) where A had
  none, GC B - A +0.7 to +1.05 s in four one-quad runs. Each quad's cluster is now
  warmed up with one untimed run of the same graph, and ``_order_balanced`` (the
  geometric mean of the ABBA and the BAAB quads' means) is printed.
- 32k with that warm-up, 4 quads (16 runs, 46-76 s each): CPU 0.938, 0.974,
  0.950, 1.036 (median 0.962; order-balanced 0.974: ABBA 0.944, BAAB 1.005),
  wall 0.924, 0.979, 0.932, 1.012 (median 0.956; balanced 0.961). Medians of
  runs: event loop A 25.81 / B 23.56 s, relay thread 0.72 s, status thread 0.06
  s, helper 2.72 s, broker 0.36 s, full collections 1 / 1, GC 1.86 / 1.77 s. B
  below A is not a negative cost (the relay thread alone is 2.6 % of the process,
  the hook's instructions 2.6 % of the event loop's): a quad resolves about 5 %,
  and these four bound the ratio, not measure it to a per cent.
- Tried on the old warm-up, one ABBA quad each: a 5 s flush interval with status
  lines every 0.5 s (the relay waking 50x less): CPU 1.262, event loop still
  +4.45 s; no compression: 3 quads 1.049, 1.237 (ABBA), 0.965 (BAAB), within the
  position effect. Neither the relay's wake-ups nor zstd explained it.
- fresh40k (fresh cluster per run, warm-up compute of the same graph, the
  scheduler not saturated): an ABBA quad (~105-128 s runs) CPU 1.157, wall
  1.101; a BAAB quad (``--first baab``, ~84-96 s runs, the machine faster) CPU
  1.097, wall 1.067; median (= order-balanced) of the two 1.127 / 1.084. Event
  loop A 56.3 / 47.9 s, B 61.4 / 57.2 s in the first; relay 1.1-1.2 s, helper
  4.2-4.5 s, broker 0.9 s a run (0.8-0.9, 2.7-3.1, 0.5-0.6 s in the second).
  There the scheduler's CPU follows the wall clock (per wall second A 0.495 /
  0.492, B 0.522 / 0.515): what the recording adds to the machine stretches the
  run, and the event loop with it.
- noop100k, 1 ABBA quad (204-237 s runs): CPU 1.116, wall 1.100, throughput
  with/without 0.909 (424 / 468 tasks/s, medians of 2 runs). Event loop B - A
  +11.5 s of 114 s, relay 2.0 s, status 0.23 s, helper 8.6 s (~85 us a task),
  broker 1.6 s.
- Who preempts the event loop (``scheduler_preemptions.py``, perf's
  sched_switch): fresh40k A 23,518, B 28,897 times a run. The recording's own
  threads and processes preempt it ~1,550 times directly (relay thread 556,
  broker 461, status thread 399, helper 141); the workers' preemptions grow with
  B's longer wall.
- Next: fresh40k is the shape left (and 200k, ~2 h of quads on this machine).
  Fewer and cheaper wake-ups near the scheduler: the relay thread reading the
  helper's status lines itself (one thread fewer), or a hand-over from the event
  loop with no thread; and the helper's CPU per event (~20 us in fresh40k)
  halved.

FINDINGS, third pass (2026-11-23, session 6): the window, instructions, contention

- The two sides were not timed over the same window. A stopped at compute's
  return; B waited for delivery and 0.2 s, and so B alone counted the released ->
  forgotten cascade of the whole graph, which runs after compute returns, when the
  client releases its result: about a fifth of a run's transitions. Seen in
  cProfile's call counts of the event loop (8,144 tasks): 8,141 more
  ``_transition_released_forgotten`` calls in B. Both sides now wait until the
  scheduler holds no task (``_settled``), then B waits for delivery, then both
  sleep 0.2 s. Every ratio of the passes below is biased against B by it.
- What runs on the event loop, exactly (cProfile call counts, which do not depend
  on timing; 8,144 tasks; settled windows; A/B/B/A on one cluster): the same Dask
  calls per task on both sides (``_run_once`` 0.648 / 0.652, ``handle_stream``
  0.937 / 0.981, ``stimulus_task_finished`` 1.000 / 1.000); B adds the
  ``transition`` hook (5 per task) and ``Transport.offer`` (1 per task: the
  processing -> memory transition carries kwargs). Nothing else of ours runs there.
- ``Transport.offer`` computed ``buffered_bytes`` and the room on every item; its
  fast case is now arithmetic on the room. The hook, B - A
  (``transition_hotpath.py --callgrind``): 4,317 -> 3,169 instructions per
  transition. Tried and dropped: the relay's ``_take_rows`` as C iterators
  (``map``/``compress``/``chain``) instead of its Python loop: slower (8,876 vs
  6,101 instructions per event; 1.2-1.6 vs 0.9-1.1 us per record in-process).
- Instructions of the event loop on a real cluster (``scheduler_instructions.py``,
  1,365 tasks, scheduler under callgrind): A 1,136,723 and 1,123,644 per task; B
  1,159,946 per task on the section with A's transitions (ratio 1.026, +7.4k per
  transition: the hook, Dask's call into one more plugin, the offered items) and
  1,180,781 on a section that also held an earlier graph's cascade. An earlier run
  (before the offer change) gave B sections 7 % apart: what a real cluster does
  depends on timing (how messages batch), so two sections a side resolve a few
  per cent, not one.
- So in instructions the scheduler process pays about 2.6 % on its event loop
  plus the relay thread (6,101 per event, about 2 % more), while its CPU seconds
  rise more: 32k, 4 quads, machine about twice as slow as in session 5 (36-61 s
  a run; runs drift by up to 45 % within a quad): CPU 1.174, 0.946, 1.203, 1.055
  (median 1.114), wall 1.143, 0.950, 1.145, 1.035 (median 1.089); event loop
  B - A +2.36 s (median of 8 runs a side), relay thread 0.68 s, status 0.04 s,
  helper 2.76 s. fresh40k, 2 quads (~100-116 s a run): see the closing note of
  #15 for the figures. py-spy on whole B and A runs of fresh40k (2,509 and 2,341
  event-loop samples, idle excluded) shows the same functions in the same shares:
  besides ``select`` (30.4 % of B's samples, 24.9 % of A's: polling, not Dask's
  work), no function differs by more than 0.7 % of samples and ours are below
  0.5 %. The event loop runs the same code, slower as a whole. The candidates are
  the co-running work the recording adds to a machine the workload already fills
  (the helper process,
  the workers' plugins, the broker: Tansu used 4 s of CPU in 22 minutes, so not
  the broker), which ``--control-burn F`` (B attaches nothing, a process busy F
  of the time runs beside it) and ``--scheduler-only`` separate.
- The lead at the end of the session: preemptions. ``/proc/<pid>/task/<pid>``
  of the scheduler's event-loop thread over one 32k run each, A B B A on one
  cluster (settled windows): user CPU 12.68 / 16.73 / 19.67 / 14.16 s, system
  0.69 / 0.62 / 0.86 / 0.55 s, minor faults 29,218 / 12,017 / 13,874 / 0,
  voluntary context switches 9,657 / 8,728 / 9,108 / 9,613, involuntary ones
  3,628 / 6,390 / 6,213 / 4,539. With the producers the event loop is preempted
  about 1.6 times as often and its user time, for the same code (instructions
  +2.6 %), rises by a quarter or more: each preemption leaves it cold caches. What
  wakes up that often is the recording's many short wake-ups on a machine the
  workload fills: the helper (a frame every flush-interval, a status line every
  ``STATUS_INTERVAL`` = 50 ms, each read by a thread of the scheduler's process
  that must take the GIL), its sends and the broker's replies. A control process
  busy 6 % of the time in one burst per 100 ms (``--control-burn 0.06``, 1 clean
  quad: CPU ratio 0.958) did not slow the scheduler. A status line per 0.5 s
  instead of 50 ms (tried once, reverted) left B preempted more than A (7,806 and
  10,602 against 5,538 and 6,435): not the main source. Next: find which wake-ups
  preempt the event loop (the helper's sends, the broker, the relay's frames),
  make them fewer and larger, and report involuntary switches in this bench.

FINDINGS, second pass (2026-11-23, session 5): the sender moved out of the process

The producers' sender now runs in a helper process (``producers/relay.py``): the
scheduler process keeps the ``transition`` hook and a relay thread that hands the
buffer over as flat rows (``marshal``, one pipe write per flush interval). Per
thread of the scheduler process, medians over runs, 32k shape:

- before (thread sender; one quad run before the change, 4 runs): sender thread
  1.67 s of 22.6 s (7.4 %); event loop B - A -0.16 s.
- after (v1 rows, 4 quads, 16 runs, machine at load ~3): relay thread 0.38 s of
  15.3 s (2.5 %), status thread 0.01 s; event loop B - A +1.54 s; helper process
  1.66 s (outside the scheduler). After (v2 flat rows, 4 quads, machine ~1.5x
  slower that hour): relay 0.65 s of 24.8 s (2.6 %); event loop B - A +4.0 s.
- instructions (``transition_hotpath.py --callgrind``, 10k transitions, 1 run
  each): scheduler process per event 26,847 with the thread sender (hook 4,329 +
  build/encode 18,735 + zstd 3,783, plus aiokafka and socket I/O not counted) vs
  10,418 with the helper (hook 4,317 + hand-over 6,101: the rest happens in the
  helper).

Ratios (with/without; scheduler-process CPU, wall):

- fresh40k (v1, 4 quads): CPU 1.025, 1.174, 1.011, 1.017 (median 1.021); wall
  0.987, 1.133, 0.996, 0.987 (median 0.991). The second quad ran while a test
  suite shared the machine.
- 32k (v1, 4 quads): CPU 1.100, 1.047, 1.243, 1.035 (median 1.073); wall 1.115,
  1.017, 1.154, 0.998 (median 1.066). 32k (v2, 4 quads): CPU 1.148, 1.047, 1.410,
  1.103 (median 1.125); wall 1.101, 1.068, 1.299, 1.043 (median 1.085).

- 200k (v2, one quad started, not finished): A 156.5 s CPU / 375 s wall, B 204.5 s /
  492 s (event loop 181.6 vs 135.1 s; relay thread 5.2 s, 2.6 %; helper 20.1 s;
  1,002,339 events). The second B run's compute finished, but the bench's
  ``run_on_scheduler(_wait_delivered)`` never returned: the scheduler held no
  pending request, the producer had delivered everything it had accepted, and one
  of the two worker processes was gone. Not resolved; no 200k ratio is claimed.

What is left on the saturated 32k shape is mostly not the producers' own code
(relay thread 2.5 % + hook ~1.5 %) but Dask's event loop itself: its CPU per run,
B - A averaged per quad, was +1.01, +0.37, +2.58, +0.24 s (v1) and +2.61, +1.21,
+6.16, +1.09 s (v2): positive in all eight quads and above the hook's ~0.2 s
(instructions x transitions). Not located yet; the candidates are GIL hand-offs
with the relay thread (it holds the GIL through a frame of up to 20,000 rows),
cache lines the two threads share (reference counts of keys and groups), and the
helper process taking CPU on a machine where the scheduler and two workers already
fill both cores. On fresh40k (default worker-saturation, the scheduler not
saturated) it is +0.04, +6.96 (the perturbed quad), +0.79, +0.05 s on ~45 s.

FINDINGS, first pass (2026-11-23, session 4, a 2-core machine shared with other
jobs, load average 2-37)

The noise first: the same code gave 32k CPU ratios of 1.290 and 1.201 in one
2-quad run and 1.085 and 1.023 in another an hour later (event-loop thread +2.5 s
median in the first, -0.36 s in the second). On this machine two quads cannot
resolve a 5 % target; what is stable is each thread's own CPU, and instructions.

Where the scheduler process's extra CPU goes, per thread (``/proc`` per-thread
utime+stime, ``bench/scheduler_profile.py``: py-spy on every thread at 200 Hz):

- The sender thread is the one cost that shows every time: 0.98-1.25 s per 32k run
  (about 160k events, ~7 us each; 7 % of a 15.6 s scheduler-process run), 0.6-0.8 s
  on the 13k-task fused shape, 7.4 s on the 200k graph (6.9 % of that run's
  106 s). Of its busy samples: socket send and re-acquiring the GIL after it
  32-50 %, building event dicts 14-18 %, zstd (aiokafka, level 3) 13 %, orjson
  7-12 %, the packing loop 6-11 %, aiokafka's own Python 8-9 %.
- The event-loop thread: producers code was 1.6 % of its busy samples on the 32k
  graph (the ``transition`` hook 1.1 %, ``update_graph`` 0.5 %: ~0.2 s) and 1.7 %
  on the 200k graph (~1.4 s, the hook; ``update_graph`` ~0: it walks at most
  ``graph-max-tasks`` = 10,000 tasks). Its median difference between sides is
  noise-dominated (+2.5 s, +1.3 s, -0.4 s in three 2-quad runs).
- Garbage collection is not it: the ``gc.callbacks`` probe shows the same CPU in
  collections with and without (0.77 vs 0.74 s before, 0.79 vs 0.71 s after per
  32k run), ~70 more gen-0 and ~3 more gen-1 collections, no gen-2 on either side.
- Dask-Offload (graph materialization): unchanged, 1.6-2.2 s.
- Instructions (``transition_hotpath.py --callgrind``, 10,000 transitions of a
  realistic mix, 4 in 5 without kwargs): before, the hook added 5,575 per
  transition and the sender spent 20,895 per event building and encoding plus
  3,778 in zstd; after (Dask's own ``transition_log`` record buffered as it is,
  encoded straight to JSON bytes), 4,316 (-23 %) and 16,415 + 3,771 (-18 % in
  all).

So the recording's cost in the scheduler process is essentially the sender thread
(~7 %) plus the hook (~1-2 %): reaching <= 5 % needs the sender's CPU halved or
moved out of the process (a helper process fed the compact records through a pipe
would leave only the hook and a pickle of the records: by estimate, not measured,
a few thousand instructions per event instead of ~20k), and zstd is 19 % of what is left (``blackbox.kafka
.compression: lz4`` costs less CPU).

SETUP

Every shape runs on a cluster whose scheduler is a process of its own (``dask
scheduler`` and ``dask worker --nworkers 2 --nthreads 1`` subprocesses, see
``process_cluster.py``), so "scheduler-process CPU" is the scheduler's alone (with
a LocalCluster the client shares the process, which dilutes the ratio), and its
threads can be told apart: ``/proc/<pid>/task/*/stat`` utime+stime per thread,
labelled with the Python thread names the scheduler reports (the producers' sender
is ``dask-blackbox-scheduler-sender``). A Tansu broker nothing consumes is started
once. A is without, B with dask-blackbox (scheduler plugin, worker plugins, log
shipping, attached with :func:`producers.attach`); a quad runs A B B A or B A A B and
its ratio (B1 + B2) / (A1 + A2) cancels linear drift. Graph optimization happens in
this process with ``optimization.fuse.active: False``.

Shapes (``--shapes``, default all):

- ``32k``: ``(da.ones((3100, 3100), chunks=20) + 1).sum()``, ~32k tasks, scheduler
  ``worker-saturation: inf`` (root tasks all sent at once: throughput bound by the
  scheduler's work). One cluster per quad, warmed up with one untimed run of the
  same graph (its heap grown to a run's size: see FINDINGS, fourth pass); the B
  runs attach the producers and detach them after.
- ``fresh40k``: the shape of issue #15's independent A/B: a fresh cluster per run,
  ``(x * 2 + 1).sum()`` of ``x = da.ones((2000, 2000), chunks=20)`` computed with
  ``optimize_graph=False`` (43k tasks; with optimization this Dask fuses the
  blockwise chain to 13k even with ``optimization.fuse.active: False``),
  default worker-saturation, B attaches right after the cluster starts, one warm-up
  compute of the same graph, then the timed one.
- ``200k``: as ``32k`` with a 7740 x 7740 array (~200k tasks), and Dask's
  ``comm.timeouts.tcp`` at 600 s (:data:`PATIENT`).
- ``noop100k``: scheduler throughput, ``client.map`` of a no-op function over
  100,000 inputs (100k independent tasks), one cluster per quad as ``32k``; the
  figure is tasks per second, with / without.

A run's CPU counts from submission until the scheduler holds no task, then (B) until
the producers' buffer is delivered (waited for inside the scheduler, at most
:data:`WAIT_DEADLINE`), then 0.2 s. Figures: per quad the wall-clock ratio and the
scheduler-process CPU ratio, their medians over quads (targets: CPU <= 1.05, wall
<= 1.03; aim CPU <= 1.03, wall <= 1.02; no-op throughput within 3%), the
order-balanced ratio (:func:`_order_balanced`), and the median over runs of each
thread's CPU seconds, A and B, of the garbage collector's work in the scheduler
process (CPU seconds inside collections and their number per generation, from a
``gc.callbacks`` probe installed on both sides), of what the rest of the machine
used meanwhile (the workers', this client's and the broker's processes), and of
the event loop's context switches (involuntary ones are preemptions).

Run: ``nice -n 5 python bench/scheduler_overhead.py [--quads 4] [--shapes 32k,200k]
[--first baab] [--scheduler-only] [--control-burn F]``
(``--quick``: 1 quad of ``32k`` and ``fresh40k`` only). A quad whose run loses a worker
process is run once more (:class:`WorkerLost`); ``BENCH_CLUSTER_LOGS=DIR`` keeps the
clusters' logs there.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable

import dask
import dask.array as da
from distributed import wait

from dask_blackbox import producers
from local_broker import local_broker
from process_cluster import (
    context_switches, cpu_by_thread, process_cluster, process_cpu, thread_cpu, thread_names,
)
from report import report


@dataclass(frozen=True)
class Shape:
    name: str
    description: str
    #: runs one timed computation on ``client``; returns the number of tasks
    compute: Callable
    #: a cheaper computation warming a quad's cluster up (None: fresh cluster per run)
    warm_up: Callable | None
    scheduler_config: dict


def _array_sum(side: int) -> Callable:
    def compute(client) -> int:
        graph = (da.ones((side, side), chunks=20) + 1).sum()
        (optimized,) = dask.optimize(graph)
        n = len(optimized.__dask_graph__())
        assert client.compute(graph).result() == 2 * side * side
        return n
    return compute


def _affine_sum(client) -> int:
    x = da.ones((2000, 2000), chunks=20)
    graph = (x * 2 + 1).sum()
    # Unoptimized: this Dask's blockwise fusion (not switched off by
    # optimization.fuse.active) would leave ~13k tasks instead of the issue's ~40k.
    n = len(graph.__dask_graph__())
    assert client.compute(graph, optimize_graph=False).result() == 3 * 2000 * 2000
    return n


def _noop(i):
    return None


def _noop_map(client) -> int:
    futures = client.map(_noop, range(100_000), pure=False)
    wait(futures)
    del futures
    return 100_000


#: ``--scheduler-only``: B attaches the scheduler plugin alone (no worker plugins,
#: no log shipping on workers), to tell the scheduler's own cost from the effect of
#: the workers' plugins on the scheduler.
SCHEDULER_ONLY = "--scheduler-only" in sys.argv


#: ``--control-burn F``: a control experiment. B attaches nothing; instead a process
#: at niceness +5, busy F of every 100 ms (what the helper and the broker add to the
#: machine), runs through B's timed run: what co-running CPU alone does to the
#: scheduler's CPU seconds on this machine.
CONTROL_BURN = (float(sys.argv[sys.argv.index("--control-burn") + 1])
                if "--control-burn" in sys.argv else 0.0)
_BURNER = """
import os, sys, time
os.nice(5)
busy = 0.1 * float(sys.argv[1])
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < busy:
        pass
    time.sleep(0.1 - busy)
"""


def _burner(with_blackbox: bool):
    """The control's co-running process for a B run (None otherwise)."""
    if not (with_blackbox and CONTROL_BURN):
        return None
    return subprocess.Popen([sys.executable, "-c", _BURNER, str(CONTROL_BURN)])


def _producing(with_blackbox: bool) -> bool:
    return with_blackbox and not CONTROL_BURN


def attach(client) -> None:
    if CONTROL_BURN:
        return
    if SCHEDULER_ONLY:
        client.register_plugin(producers.BlackboxSchedulerPlugin(
            producers.ProducerSettings.resolve()), name=producers.PLUGIN_NAME)
    else:
        producers.attach(client)


async def _detach_scheduler_plugin(dask_scheduler) -> None:
    plugin = dask_scheduler.plugins.get(producers.PLUGIN_NAME)
    if plugin is not None:
        dask_scheduler.remove_plugin(producers.PLUGIN_NAME)
        await plugin.close()


def detach(client) -> None:
    if CONTROL_BURN:
        return
    if SCHEDULER_ONLY:
        client.run_on_scheduler(_detach_scheduler_plugin)
    else:
        producers.detach(client)


SATURATED = {"distributed.scheduler.worker-saturation": "inf"}
#: On 2 cores, a 200k-task graph's root tasks all sent at once keep a worker from
#: reading its connection to the scheduler for long enough that the kernel's 30 s
#: TCP_USER_TIMEOUT (Dask's ``comm.timeouts.tcp``) breaks it, in A and B runs alike
#: (3 of about 12 runs in session 11: "worker-handle-scheduler-connection-broken");
#: the run is then not comparable.
PATIENT = {"distributed.comm.timeouts.tcp": "600s"}
SHAPES = {
    "32k": Shape("32k", "(ones(3100x3100, chunks 20) + 1).sum(), worker-saturation inf",
                 _array_sum(3100), _array_sum(3100), SATURATED),
    "fresh40k": Shape("fresh40k", "(ones(2000x2000, chunks 20) * 2 + 1).sum(), fresh "
                      "cluster per run, warm-up compute", _affine_sum, None, {}),
    "200k": Shape("200k", "(ones(7740x7740, chunks 20) + 1).sum(), worker-saturation inf",
                  _array_sum(7740), _array_sum(7740), {**SATURATED, **PATIENT}),
    "noop100k": Shape("noop100k", "client.map(no-op, range(100_000))", _noop_map,
                      _noop_map, {}),
}


#: How long the waits below may take before the bench gives up on a run (a 200k
#: run's delivery once never finished, see FINDINGS).
WAIT_DEADLINE = 600.0


async def _wait_delivered(dask_scheduler, deadline: float = WAIT_DEADLINE) -> None:
    """On the scheduler: wait until everything the producer accepted was delivered
    (TimeoutError, with the transport's stats, after ``deadline`` seconds)."""
    import asyncio
    import time as _time

    transport = dask_scheduler.plugins["dask-blackbox"].transport
    target = transport.accepted_events
    give_up = _time.monotonic() + deadline
    while not transport.delivered(target):
        if _time.monotonic() > give_up:
            raise TimeoutError(f"{target} accepted events not delivered within "
                               f"{deadline:.0f}s: {transport.stats()}")
        await asyncio.sleep(0.005)


async def _settled(dask_scheduler, deadline: float = WAIT_DEADLINE) -> None:
    """On the scheduler: wait until the computation's tasks are all forgotten (the
    client released its result: the released -> forgotten cascade of the whole
    graph runs after compute returns); TimeoutError after ``deadline`` seconds."""
    import asyncio
    import time as _time

    give_up = _time.monotonic() + deadline
    while dask_scheduler.tasks:
        if _time.monotonic() > give_up:
            raise TimeoutError(f"{len(dask_scheduler.tasks)} tasks still held after "
                               f"{deadline:.0f}s")
        await asyncio.sleep(0.005)


def _gc_probe(dask_scheduler) -> tuple:
    """On the scheduler: CPU seconds spent in garbage collections, their number per
    generation, and the CPU seconds per generation so far (a gc callback installed
    on first call, on both sides)."""
    import gc
    import time as _time

    state = getattr(dask_scheduler, "_bench_gc", None)
    if state is None:
        state = dask_scheduler._bench_gc = [0.0, 0, 0, 0, 0.0, 0.0, 0.0, 0.0]

        def callback(phase, info, state=state):
            if phase == "start":
                state[4] = _time.thread_time()
            else:
                took = _time.thread_time() - state[4]
                state[0] += took
                state[1 + info["generation"]] += 1
                state[5 + info["generation"]] += took
        gc.callbacks.append(callback)
    return (*state[:4], *state[5:])


@dataclass
class Run:
    with_blackbox: bool
    wall: float
    cpu: float
    threads: dict[str, float]
    tasks: int
    #: CPU s in collections, collections of generations 0, 1, 2, CPU s in each
    gc: tuple = (0.0, 0, 0, 0, 0.0, 0.0, 0.0)
    #: CPU seconds of the producers' helper process (``producer.sender: process``)
    helper_cpu: float = 0.0
    #: the event loop's (voluntary, involuntary) context switches: the second are
    #: preemptions
    switches: tuple[int, int] = (0, 0)
    #: CPU seconds of the worker processes, and of this (the client's) process
    workers_cpu: float = 0.0
    client_cpu: float = 0.0
    broker_cpu: float = 0.0
    #: seconds B's producer took, once the graph was forgotten, to deliver what it
    #: had accepted (how far behind the helper was)
    behind: float = 0.0

    @property
    def cpu_with_helper(self) -> float:
        return self.cpu + self.helper_cpu


def _helper_cpu(dask_scheduler) -> float:
    """On the scheduler: CPU seconds the producers' helper process used so far."""
    plugin = dask_scheduler.plugins.get("dask-blackbox")
    if plugin is None or plugin.transport is None:
        return 0.0
    return plugin.transport.stats().get("relay_cpu_seconds") or 0.0


def timed(client, pid: int, shape: Shape, with_blackbox: bool) -> Run:
    names = thread_names(client)
    gc0 = client.run_on_scheduler(_gc_probe)
    helper0 = client.run_on_scheduler(_helper_cpu)
    workers = list(client.run(os.getpid).values())
    burner = _burner(with_blackbox)
    before, cpu0, machine0 = thread_cpu(pid), process_cpu(pid), _machine(pid, workers)
    t0 = time.perf_counter()
    try:
        n = shape.compute(client)
    finally:
        if burner is not None:
            burner.kill()
            burner.wait()
    wall = time.perf_counter() - t0
    # The same window on both sides: until the graph is forgotten (counting only to
    # compute's return left that cascade out of A and, through the wait below, in
    # B), then B's delivery, then 0.2 s (the helper's last status carries its CPU).
    client.run_on_scheduler(_settled)
    settled = time.perf_counter()
    if _producing(with_blackbox):  # the sender's work counts too
        client.run_on_scheduler(_wait_delivered)
    behind = time.perf_counter() - settled
    time.sleep(0.2)
    after, cpu1, machine1 = thread_cpu(pid), process_cpu(pid), _machine(pid, workers)
    helper = client.run_on_scheduler(_helper_cpu) - helper0
    gc1 = client.run_on_scheduler(_gc_probe)
    names.update(thread_names(client))
    voluntary, involuntary, workers_cpu, client_cpu, broker_cpu = (
        b - a for a, b in zip(machine0, machine1))
    return Run(with_blackbox, wall, cpu1 - cpu0, cpu_by_thread(before, after, names), n,
               tuple(b - a for a, b in zip(gc0, gc1)), helper, (voluntary, involuntary),
               workers_cpu, client_cpu, broker_cpu, behind)


#: the benchmark's broker process (its CPU is reported per run)
BROKER_PIDS: list[int] = []


class WorkerLost(RuntimeError):
    """A worker process ended during a timed run (Dask recomputed its tasks on the
    other): the run is not comparable, its quad is run again."""


def _machine(pid: int, workers: list[int]) -> tuple[float, ...]:
    """What the rest of the machine has done so far: the event loop's (voluntary,
    involuntary) context switches, the CPU seconds of the worker processes, of this
    process and of the broker."""
    try:
        workers_cpu = sum(process_cpu(p) for p in workers)
    except FileNotFoundError as e:
        raise WorkerLost(f"a worker process ended during the run ({e.filename}); "
                         "set BENCH_CLUSTER_LOGS=DIR to keep the clusters' logs") from None
    return (*context_switches(pid), workers_cpu, time.process_time(),
            sum(process_cpu(p) for p in BROKER_PIDS))


def quad_of(q: int) -> tuple[bool, ...]:
    return (False, True, True, False) if q % 2 == 0 else (True, False, False, True)


def ratio(runs: list[Run], figure: str) -> float:
    return ratio_of(runs, figure, figure)


def ratio_of(runs: list[Run], b_figure: str, a_figure: str) -> float:
    b = sum(getattr(r, b_figure) for r in runs if r.with_blackbox)
    a = sum(getattr(r, a_figure) for r in runs if not r.with_blackbox)
    return b / a


def run_shape(shape: Shape, quads: int, first: int = 0) -> list[list[Run]]:
    """``quads`` quads, the first ABBA (``first`` 0) or BAAB (1), alternating."""
    out = []
    for q in range(first, first + quads):
        for attempt in (1, 2):
            try:
                out.append(_quad(shape, q))
                break
            except WorkerLost as e:
                print(f"  {shape.name} quad {q + 1}: {e}" + ("; once more" if attempt == 1
                                                            else "; given up"), flush=True)
                if attempt == 2:
                    raise
        runs = out[-1]
        print(f"  {shape.name} quad {q + 1}: wall ratio {ratio(runs, 'wall'):.3f}, "
              f"scheduler CPU ratio {ratio(runs, 'cpu'):.3f}", flush=True)
    return out


def _quad(shape: Shape, q: int) -> list[Run]:
    """The runs of quad ``q`` (see :func:`quad_of`)."""
    runs = []
    if shape.warm_up is not None:
        with process_cluster(2, shape.scheduler_config) as (client, pid):
            shape.warm_up(client)
            for with_blackbox in quad_of(q):
                if with_blackbox:
                    attach(client)
                runs.append(timed(client, pid, shape, with_blackbox))
                if with_blackbox:
                    detach(client)
                _print_run(shape, q, runs[-1])
    else:
        for with_blackbox in quad_of(q):
            with process_cluster(2, shape.scheduler_config) as (client, pid):
                if with_blackbox:
                    attach(client)
                shape.compute(client)  # warm-up, the same graph
                if _producing(with_blackbox):
                    client.run_on_scheduler(_wait_delivered)
                runs.append(timed(client, pid, shape, with_blackbox))
            _print_run(shape, q, runs[-1])
    return runs


def _print_run(shape: Shape, q: int, r: Run) -> None:
    top = sorted(r.threads.items(), key=lambda kv: -kv[1])[:4]
    helper = (f"  helper {r.helper_cpu:5.2f}s (delivered {r.behind:.2f}s after)"
              if r.with_blackbox else "")
    print(f"    {shape.name} quad {q + 1} {'B with   ' if r.with_blackbox else 'A without'}"
          f"  wall {r.wall:6.2f}s  scheduler CPU {r.cpu:6.2f}s{helper}  "
          + ", ".join(f"{k} {v:.2f}s" for k, v in top)
          + f"; event loop preempted {r.switches[1]:,}x, yielded {r.switches[0]:,}x; "
          f"workers {r.workers_cpu:.2f}s, client {r.client_cpu:.2f}s, "
          f"broker {r.broker_cpu:.2f}s; gc {r.gc[0]:.2f}s ({r.gc[3]} full: {r.gc[6]:.2f}s)", flush=True)


def _abba(runs: list[Run]) -> bool:
    return not runs[0].with_blackbox


def _order_means(ratios: list[float], abba: list[bool]) -> tuple[float, float]:
    """The mean ratio of the ABBA quads and of the BAAB quads."""
    return (statistics.mean(r for r, o in zip(ratios, abba) if o),
            statistics.mean(r for r, o in zip(ratios, abba) if not o))


def _order_balanced(ratios: list[float], abba: list[bool]) -> float:
    """The geometric mean of :func:`_order_means`: a cost of a run's position in its
    cluster's sequence (not a linear drift) multiplies one order's ratios and
    divides the other's by the same factor."""
    abba_mean, baab_mean = _order_means(ratios, abba)
    return (abba_mean * baab_mean) ** 0.5


def summarize(shape: Shape, quads: list[list[Run]]) -> None:
    every = [r for runs in quads for r in runs]
    walls = [ratio(runs, "wall") for runs in quads]
    cpus = [ratio(runs, "cpu") for runs in quads]
    n = every[0].tasks
    print(f"\n{shape.name}: {shape.description}; {n:,} tasks; {len(quads)} quads "
          f"({len(every)} runs, ABBA/BAAB)")
    print(f"  wall ratios per quad : {', '.join(f'{x:.3f}' for x in walls)}"
          f"   MEDIAN {statistics.median(walls):.3f} (target <= 1.03, aim <= 1.02)")
    print(f"  CPU ratios per quad  : {', '.join(f'{x:.3f}' for x in cpus)}"
          f"   MEDIAN {statistics.median(cpus):.3f} (target <= 1.05, aim <= 1.03)")
    abba = [_abba(runs) for runs in quads]
    if any(abba) and not all(abba):
        for what, figures in (("wall", walls), ("CPU", cpus)):
            abba_mean, baab_mean = _order_means(figures, abba)
            print(f"  {what} order-balanced: {_order_balanced(figures, abba):.3f} "
                  f"(ABBA quads {abba_mean:.3f}, BAAB quads {baab_mean:.3f})")
    if shape.name == "noop100k":
        a = statistics.median(n / r.wall for r in every if not r.with_blackbox)
        b = statistics.median(n / r.wall for r in every if r.with_blackbox)
        thr = [1 / w for w in walls]
        print(f"  no-op throughput: without {a:,.0f} tasks/s, with {b:,.0f} tasks/s "
              f"(medians of runs); with/without per quad {', '.join(f'{x:.3f}' for x in thr)}"
              f"   MEDIAN {statistics.median(thr):.3f} (target >= 0.97)")
        report("no-op throughput with/without (100k tasks)", statistics.median(thr), "x",
               target=0.97, better="higher")
    labels = sorted({k for r in every for k in r.threads},
                    key=lambda k: -max(r.threads.get(k, 0) for r in every))
    print(f"  scheduler-process CPU seconds per thread (median over runs; A n={len(every)//2}, "
          f"B n={len(every)//2}):")
    print(f"    {'thread':38s} {'A without':>10s} {'B with':>10s} {'B - A':>8s}")
    for label in labels:
        a = statistics.median(r.threads.get(label, 0.0) for r in every if not r.with_blackbox)
        b = statistics.median(r.threads.get(label, 0.0) for r in every if r.with_blackbox)
        if max(a, b) >= 0.01:
            print(f"    {label[:38]:38s} {a:10.2f} {b:10.2f} {b - a:+8.2f}")
    a = statistics.median(r.cpu for r in every if not r.with_blackbox)
    b = statistics.median(r.cpu for r in every if r.with_blackbox)
    print(f"    {'whole process':38s} {a:10.2f} {b:10.2f} {b - a:+8.2f}")
    h = statistics.median(r.helper_cpu for r in every if r.with_blackbox)
    print(f"    {'helper process (not the scheduler)':38s} {0.0:10.2f} {h:10.2f} {h:+8.2f}")
    d = statistics.median(r.behind for r in every if r.with_blackbox)
    print(f"    {'delivered after the graph was gone (s)':38s} {0.0:10.2f} {d:10.2f} {d:+8.2f}")
    for what, figure in (("workers' processes (CPU s)", lambda r: r.workers_cpu),
                         ("this client's process (CPU s)", lambda r: r.client_cpu),
                         ("the broker's process (CPU s)", lambda r: r.broker_cpu)):
        a = statistics.median(figure(r) for r in every if not r.with_blackbox)
        b = statistics.median(figure(r) for r in every if r.with_blackbox)
        print(f"    {what:38s} {a:10.2f} {b:10.2f} {b - a:+8.2f}")
    for i, what in ((1, "event loop preempted (involuntary cs)"),
                    (0, "event loop yielded (voluntary cs)")):
        a = statistics.median(r.switches[i] for r in every if not r.with_blackbox)
        b = statistics.median(r.switches[i] for r in every if r.with_blackbox)
        print(f"    {what:38s} {a:10,.0f} {b:10,.0f} {b - a:+8,.0f}")
    both = [ratio_of(runs, "cpu_with_helper", "cpu") for runs in quads]
    print(f"  (scheduler + helper) / scheduler CPU per quad: "
          f"{', '.join(f'{x:.3f}' for x in both)}   MEDIAN {statistics.median(both):.3f}")
    for i, what in enumerate(("in garbage collection (CPU s)", "gen-0 collections",
                              "gen-1 collections", "gen-2 collections",
                              "  CPU s in gen-0 collections", "  CPU s in gen-1 collections",
                              "  CPU s in gen-2 collections")):
        a = statistics.median(r.gc[i] for r in every if not r.with_blackbox)
        b = statistics.median(r.gc[i] for r in every if r.with_blackbox)
        print(f"    {what:38s} {a:10.0f} {b:10.0f} {b - a:+8.0f}" if 1 <= i <= 3 else
              f"    {what:38s} {a:10.2f} {b:10.2f} {b - a:+8.2f}")
    report(f"scheduler overhead {shape.name}, wall ratio", statistics.median(walls), "x",
           target=1.03, aim=1.02)
    report(f"scheduler overhead {shape.name}, scheduler-process CPU ratio",
           statistics.median(cpus), "x", target=1.05, aim=1.03)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("quads_pos", nargs="?", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--quads", type=int, default=4)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--scheduler-only", action="store_true",
                        help="B attaches the scheduler plugin only")
    parser.add_argument("--control-burn", type=float, default=0.0, metavar="F",
                        help="control: B attaches nothing, a process busy F of the "
                        "time runs beside it")
    parser.add_argument("--first", choices=("abba", "baab"), default="abba",
                        help="the order of the first quad (they alternate)")
    args = parser.parse_args()
    quads = args.quads_pos or (1 if args.quick else args.quads)
    names = "32k,fresh40k" if args.quick else args.shapes
    unknown = [s for s in names.split(",") if s not in SHAPES]
    if unknown:
        sys.exit(f"--shapes: unknown {unknown}; choose from {', '.join(SHAPES)}")
    results = {}
    for name in names.split(","):
        results[name] = run_shape(SHAPES[name], quads, first=int(args.first == "baab"))
    for name, quads_ in results.items():
        summarize(SHAPES[name], quads_)


if __name__ == "__main__":
    with local_broker(**{"optimization.fuse.active": False}) as broker:
        BROKER_PIDS.append(broker.proc.pid)
        main()
