"""Pure planning logic of the fetch coordinator (parts/partition/coordinator/trace.py, plan.py)."""

import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parts.partition.coordinator.debug import (KINDS, RECORD_LEN, DebugPoint, decode,
                                               divergence_message, encode, ids_digest)
from parts.partition.coordinator.plan import (Knobs, build_plan, choose_evictions, collective_bytes,
                                  keep_after_use, next_use, prefetch_chunks, prefetch_targets,
                                  reuse_distance, select_persistent)
from parts.partition.coordinator.trace import (BACKWARD, FORWARD, TraceBook, first_divergence, phase_name,
                                   trace_digest)

SETTINGS = settings(max_examples=30, deadline=None)

sizes_st = st.dictionaries(st.integers(0, 30), st.integers(1, 50), min_size=1, max_size=12)


@st.composite
def plans(draw):
    """A random plan: parameter sizes and a trace of parameter sets over them."""
    sizes = draw(sizes_st)
    ids = sorted(sizes)
    sets = draw(st.lists(st.lists(st.sampled_from(ids), max_size=4), min_size=1, max_size=12))
    persistent = draw(st.sets(st.sampled_from(ids), max_size=3))
    return sizes, sets, persistent


events_st = st.lists(st.tuples(st.sampled_from([FORWARD, BACKWARD]), st.integers(0, 5)),
                     min_size=1, max_size=10)


# ---------------------------------------------------------------------------- knobs
@pytest.mark.parametrize("knob", ["prefetch_bucket_size", "max_reuse_distance", "max_live_parameters",
                                  "persistence_threshold", "model_persistence_threshold"])
def test_negative_knob_names_it(knob):
    with pytest.raises(ValueError, match=knob):
        Knobs(**{knob: -1})
    with pytest.raises(TypeError, match=knob):
        Knobs(**{knob: 1.5})


def test_knob_bool_fields_checked():
    with pytest.raises(TypeError, match="overlap_comm"):
        Knobs(overlap_comm="yes")
    assert Knobs().model_persistence_threshold == sys.maxsize


# ---------------------------------------------------------------------- persistence
@SETTINGS
@given(sizes_st, st.integers(0, 60), st.integers(0, 200))
def test_persistent_selection_respects_both_thresholds(sizes, threshold, budget):
    chosen = select_persistent(sizes, threshold, budget)
    assert all(sizes[pid] <= threshold for pid in chosen)
    assert sum(sizes[pid] for pid in chosen) <= budget
    # greedy smallest-first: every unchosen small param would overflow the budget or is larger
    # than some chosen one's successor in (size, id) order
    order = sorted(sizes.items(), key=lambda kv: (kv[1], kv[0]))
    prefix = [pid for pid, _ in order[:len(chosen)]]
    assert set(prefix) == chosen


def test_persistent_selection_example():
    assert select_persistent({1: 5, 2: 3, 3: 100}, threshold=10, budget=sys.maxsize) == {1, 2}
    assert select_persistent({1: 5, 2: 3, 3: 100}, threshold=10, budget=4) == {2}
    assert select_persistent({1: 5}, threshold=0, budget=sys.maxsize) == frozenset()


def test_collective_bytes_formula():
    assert collective_bytes(8, 2, 4) == 32
    assert collective_bytes(8, 1, 4) == 0
    assert collective_bytes(3, 4, 2) == 18


# -------------------------------------------------------------------------- plan
@SETTINGS
@given(plans())
def test_plan_tables_agree_with_brute_force(case):
    sizes, sets, persistent = case
    plan = build_plan(sets, sizes, persistent)
    for k, ids in enumerate(sets):
        assert set(plan.sets[k]) == set(ids) - persistent
        assert plan.prefix[k + 1] - plan.prefix[k] == sum(sizes[p] for p in set(ids) - persistent)
    for pid in sizes:
        for after in range(-1, len(sets)):
            brute = next((k for k in range(after + 1, len(sets))
                          if pid in sets[k] and pid not in persistent), None)
            assert next_use(plan, pid, after) == brute
            if brute is not None and after >= 0:
                between = sum(sizes[q] for k in range(after + 1, brute) for q in plan.sets[k])
                assert reuse_distance(plan, after, brute) == between


@SETTINGS
@given(plans(), st.integers(0, 200), st.integers(0, 300), st.data())
def test_prefetch_window_and_budget(case, bucket, max_live, data):
    sizes, sets, persistent = case
    plan = build_plan(sets, sizes, persistent)
    position = data.draw(st.integers(0, len(sets) - 1))
    resident_ids = data.draw(st.sets(st.sampled_from(sorted(sizes))))
    live = data.draw(st.integers(0, max_live))
    targets, horizon = prefetch_targets(plan, position, bucket, live, max_live,
                                        resident_ids.__contains__)
    assert len(set(targets)) == len(targets), "a param is never prefetched twice"
    assert not set(targets) & resident_ids and not set(targets) & persistent
    assert live + sum(sizes[p] for p in targets) <= max_live
    assert position + 1 <= horizon <= len(sets)
    # targets are exactly the non-resident params of the covered sets position+1 .. horizon-1
    covered = {q for k in range(position + 1, horizon) for q in plan.sets[k]}
    assert set(targets) == covered - resident_ids
    if bucket == 0:
        assert targets == () and horizon == position + 1
    elif horizon < len(sets):  # stopped by the window or by the budget
        window = plan.prefix[horizon] - plan.prefix[position + 1]
        nxt = set(plan.sets[horizon]) - resident_ids - covered
        assert window >= bucket or live + sum(sizes[p] for p in targets) + sum(sizes[p] for p in nxt) > max_live
    # resuming from the horizon covers what a single walk would (nothing became resident)
    more, end = prefetch_targets(plan, position, bucket, live + sum(sizes[p] for p in targets), max_live,
                                 lambda pid: pid in resident_ids or pid in targets, start=horizon)
    assert end >= horizon and not set(more) & set(targets)


def test_prefetch_example_window():
    sizes = {1: 10, 2: 10, 3: 10, 4: 10}
    plan = build_plan([[1], [2], [3], [4]], sizes)
    nothing = lambda pid: False  # noqa: E731
    assert prefetch_targets(plan, 0, 15, 0, 100, nothing) == ((2, 3), 3)  # window 10 < 15: one more
    assert prefetch_targets(plan, 0, 10, 0, 100, nothing) == ((2,), 2)
    assert prefetch_targets(plan, 0, 100, 75, 100, nothing) == ((2, 3), 3)  # budget stops at 95
    assert prefetch_targets(plan, 0, 100, 0, 100, lambda pid: pid == 3) == ((2, 4), 4)
    assert prefetch_targets(plan, 0, 15, 0, 100, nothing, start=2) == ((3,), 3)  # 2 was covered


@SETTINGS
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 6)), unique_by=lambda t: t[0]),
       st.integers(0, 50))
def test_prefetch_chunks_partition_in_position_order(items, min_chunk):
    ids = [pid for pid, _ in items]
    positions = [pos for _, pos in items]
    sizes = {pid: pid for pid in ids}
    pos_of = dict(items)
    chunks = prefetch_chunks(ids, positions, sizes, min_chunk)
    flat = [pid for chunk in chunks for pid in chunk]
    assert sorted(flat) == sorted(ids)  # every id exactly once
    assert [pos_of[p] for p in flat] == sorted(positions)  # nearest module first
    for chunk, nxt in zip(chunks, chunks[1:]):
        assert sum(sizes[p] for p in chunk) >= min_chunk  # only a full chunk is cut ...
        assert pos_of[chunk[-1]] != pos_of[nxt[0]]  # ... and never inside one module's set
    if min_chunk == 0:
        assert len(chunks) == len(set(positions))


@SETTINGS
@given(plans(), st.integers(0, 300), st.integers(0, 120), st.data())
def test_keep_after_use_respects_distance_and_budget(case, max_live, max_reuse, data):
    sizes, sets, persistent = case
    plan = build_plan(sets, sizes, persistent)
    position = data.draw(st.integers(0, len(sets) - 1))
    candidates = [p for p in plan.sets[position]]
    live = sum(sizes[p] for p in candidates) + data.draw(st.integers(0, max_live))
    kept = keep_after_use(plan, position, candidates, live, max_live, max_reuse)
    assert kept <= set(candidates)
    for pid in kept:
        later = next_use(plan, pid, position)
        assert later is not None and reuse_distance(plan, position, later) < max_reuse
    released = sum(sizes[p] for p in set(candidates) - kept)
    assert not kept or live - released <= max_live
    if max_reuse == 0:
        assert kept == frozenset()


@SETTINGS
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(1, 9),
                          st.one_of(st.none(), st.integers(0, 30))), unique_by=lambda c: c[0]),
       st.integers(-5, 60))
def test_evictions_free_enough_farthest_first(candidates, excess):
    chosen = choose_evictions(candidates, excess)
    size = {c[0]: c[1] for c in candidates}
    nxt = {c[0]: c[2] for c in candidates}
    freed = sum(size[p] for p in chosen)
    if excess <= 0:
        assert chosen == ()
        return
    assert freed >= excess or len(chosen) == len(candidates)
    rank = lambda p: float("inf") if nxt[p] is None else nxt[p]  # noqa: E731
    not_chosen = set(size) - set(chosen)
    if not_chosen and chosen:
        assert min(rank(p) for p in chosen) >= max(rank(p) for p in not_chosen)
    # minimal: dropping the last victim would not free enough
    assert sum(size[p] for p in chosen[:-1]) < excess


# ------------------------------------------------------------------------- traces
def test_phase_names():
    assert phase_name(True, True) == "train"
    assert phase_name(False, False) == "eval/no_grad"
    assert phase_name(False, True) != phase_name(True, True)


@SETTINGS
@given(events_st)
def test_first_step_records_second_replays(events):
    book = TraceBook()
    book.begin("train")
    for e in events:
        assert book.observe("train", e).position is None
    assert book.end("train").outcome == "recorded"
    book.begin("train")
    for k, e in enumerate(events):
        obs = book.observe("train", e)
        assert obs.position == k and not obs.miss
    assert book.end("train").outcome == "replayed"


@SETTINGS
@given(events_st, events_st)
def test_divergence_falls_back_and_rerecords(first, second):
    book = TraceBook(max_traces=1)
    book.begin("train")
    for e in first:
        book.observe("train", e)
    book.end("train")
    book.begin("train")
    split = first_divergence(first, second)
    misses = 0
    for k, e in enumerate(second):
        obs = book.observe("train", e)
        misses += obs.miss
        if split is None or k < split:
            assert obs.position == k
        else:
            assert obs.position is None  # on demand for the rest of the step
    assert misses <= 1, "a miss is reported once per step, not per event"
    record = book.end("train")
    assert record.outcome == ("replayed" if split is None else "diverged")
    assert book.traces("train")[0].events == tuple(second)


def test_alternating_traces_both_replay_after_recording():
    a = [(FORWARD, 0), (FORWARD, 1), (FORWARD, 2), (BACKWARD, 2), (BACKWARD, 1), (BACKWARD, 0)]
    b = [(FORWARD, 0), (FORWARD, 2), (BACKWARD, 2), (BACKWARD, 0)]
    book = TraceBook()
    outcomes = []
    for events in [a, b, a, b, a]:
        book.begin("train")
        for e in events:
            book.observe("train", e)
        outcomes.append(book.end("train").outcome)
    assert outcomes == ["recorded", "diverged", "replayed", "replayed", "replayed"]


def test_phases_are_separate():
    book = TraceBook()
    for phase, events in [("train", [(FORWARD, 0), (BACKWARD, 0)]), ("eval/no_grad", [(FORWARD, 0)])]:
        book.begin(phase)
        for e in events:
            book.observe(phase, e)
        book.end(phase)
    book.begin("eval/no_grad")
    assert book.observe("eval/no_grad", (FORWARD, 0)).position == 0
    assert book.end("eval/no_grad").outcome == "replayed"
    assert book.state("train") == "idle"


def test_digest_depends_on_names_and_order():
    names = ["", "a", "b"]
    e1 = [(FORWARD, 1), (FORWARD, 2)]
    assert trace_digest(e1, names) == trace_digest(list(e1), list(names))
    assert trace_digest(e1, names) != trace_digest(e1[::-1], names)
    assert trace_digest(e1, names) != trace_digest(e1, ["", "a", "c"])
    assert first_divergence(e1, e1) is None
    assert first_divergence(e1, e1[:1]) == 1


# ------------------------------------------------------------- debug-mode fingerprints

points_st = st.builds(DebugPoint, st.text(min_size=1, max_size=24).filter(lambda s: "\0" not in s
                                                                           and len(s.encode()) <= 24),
                      st.integers(-1, 10**6), st.integers(-1, 10**6), st.sampled_from(KINDS),
                      st.integers(-1, 500), st.integers(0, 10**6), st.integers(0, (1 << 62) - 1))


@SETTINGS
@given(points_st)
def test_debug_record_has_fixed_length_and_round_trips(point):
    row = encode(point)
    assert len(row) == RECORD_LEN and all(-(1 << 63) <= v < (1 << 63) for v in row)
    assert decode(row) == point


@SETTINGS
@given(points_st, points_st)
def test_debug_records_differ_when_points_differ(a, b):
    assert (encode(a) == encode(b)) == (a == b)


def test_ids_digest_is_order_sensitive_and_stable():
    assert ids_digest([1, 2, 3]) == ids_digest([1, 2, 3]) != ids_digest([3, 2, 1])
    assert ids_digest([12, 3]) != ids_digest([1, 23])


def test_divergence_message_names_both_sides():
    names = ["", "stem", "blocks.0", "blocks.1"]
    message = divergence_message([DebugPoint("train", 3, 4, "F", 3),
                                  DebugPoint("eval/no_grad", 0, 2, "prefetch", 2, count=5)], names)
    assert "ranks diverged at event 2" in message
    assert "rank 0 is at the forward of module 'blocks.1' (event 4 of train step 3)" in message
    assert ("rank 1 is at a prefetch of 5 parameters for module 'blocks.0' "
            "(event 2 of eval/no_grad step 0)") in message
    refresh = divergence_message([DebugPoint("train", 1, 0, "start", count=0),
                                  DebugPoint("train", 1, 0, "start", count=2, digest=7)], names)
    assert "disagree on which persistent parameters changed" in refresh and "rank 1: 2" in refresh
