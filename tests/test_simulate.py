"""The timeline simulator against the published bubble formulas and the seed's figures."""

from __future__ import annotations

import itertools

import pytest

from parallel_lab.errors import ParallelLabError
from parallel_lab.schedules.generators import build_schedule
from parallel_lab.simulate import Costs, Interval, bubble_formula, simulate, text_timeline, timeline_stats

PS = (2, 3, 4, 8)
MS = tuple(range(1, 17)) + (32, 64)
COSTS = (Costs(1, 1, 1), Costs(1, 0.5, 0.5), Costs(2, 1.5, 0.5), Costs(1, 3, 1))


@pytest.mark.parametrize("p", PS)
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m(p):
    # Huang et al. 2019 / Narayanan et al. 2021: (p-1)/m for any F and B, equal for both schedules
    for m, c in itertools.product(MS, COSTS):
        g = simulate(build_schedule("gpipe", p, m), c)
        o = simulate(build_schedule("1f1b", p, m), c)
        assert g.bubble_ratio == pytest.approx((p - 1) / m, rel=1e-12)
        assert o.bubble_ratio == pytest.approx((p - 1) / m, rel=1e-12)
        assert g.step_time == pytest.approx((m + p - 1) * (c.f + c.b + c.w))
        # idle fraction of the whole step: (p-1)/(m+p-1)
        assert o.idle_fraction == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p", PS)
def test_interleaved_bubble_is_p_minus_1_over_vm(p):
    # Narayanan et al. 2021, section 2.2.2: the bubble shrinks by the number of chunks v
    for m in (x for x in MS if x % p == 0):
        for v, c in itertools.product((1, 2, 4), COSTS):
            r = simulate(build_schedule("interleaved", p, m, v), c)
            assert r.bubble_ratio == pytest.approx((p - 1) / (v * m), rel=1e-12), (p, m, v, c)


def test_seed_bubble_figures_p8():
    # seed: p=8: m=4 -> 175.0%, 8 -> 87.5%, 16 -> 43.8%, 32 -> 21.9%, 64 -> 10.9% (rounded to 0.1%)
    seed = {4: 175.0, 8: 87.5, 16: 43.8, 32: 21.9, 64: 10.9}
    for name in ("gpipe", "1f1b"):
        for m, pct in seed.items():
            r = simulate(build_schedule(name, 8, m))  # default costs, as `parallel-lab bubble` uses
            assert round(100 * r.bubble_ratio, 1) == pytest.approx(pct)


@pytest.mark.parametrize("p", PS)
def test_zb_h1_bubble_qi_et_al(p):
    # Qi et al. 2023, section 2.1: ZB-H1's bubble is (p-1)(T_F + T_B - T_W) (for m >= p), and with
    # T_F = T_B = T_W the bubble rate is (p-1)/(3m): a third of 1F1B's (p-1)/m.
    for m in MS:
        z = simulate(build_schedule("zb-h1", p, m), Costs(1, 1, 1))
        o = simulate(build_schedule("1f1b", p, m), Costs(1, 1, 1))
        if m >= p:
            assert z.bubble_time == pytest.approx((p - 1) * (1 + 1 - 1))
            assert z.bubble_ratio == pytest.approx((p - 1) / (3 * m))
            assert z.bubble_ratio == pytest.approx(o.bubble_ratio / 3)
        else:
            assert z.bubble_ratio < o.bubble_ratio
    for m, c in itertools.product((p, 2 * p, 16, 64), COSTS[:3]):   # w <= min(f, b)
        z = simulate(build_schedule("zb-h1", p, m), c)
        assert z.bubble_time == pytest.approx((p - 1) * (c.f + c.b - c.w))


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "zb-h1"])
def test_bubble_formula_equals_simulation(name):
    for p, m, v, c in itertools.product(PS, MS, (1, 2, 4), COSTS):
        if (name != "interleaved" and v > 1) or (name == "interleaved" and m % p):
            continue
        r = simulate(build_schedule(name, p, m, v), c)
        assert bubble_formula(name, p, m, v, c) == pytest.approx(r.bubble_ratio, rel=1e-12), (p, m, v, c)


def test_p2p_latency_lengthens_the_pipeline():
    # each of the 2(p-1) hops of the critical path (fill and drain) costs one message time
    p, m, lat = 4, 8, 0.1
    r0 = simulate(build_schedule("1f1b", p, m), Costs(1, 1, 1, 0.0))
    r1 = simulate(build_schedule("1f1b", p, m), Costs(1, 1, 1, lat))
    assert r1.step_time > r0.step_time
    assert r1.step_time >= r0.step_time + 2 * (p - 1) * lat - 1e-9


def test_timeline_intervals_do_not_overlap_and_gaps_add_up():
    r = simulate(build_schedule("zb-h1", 4, 8))
    for rank in range(4):
        ivs = [i for i in r.timeline if i.rank == rank]
        assert all(a.t_end <= b.t_start + 1e-12 for a, b in zip(ivs, ivs[1:], strict=False))
        idle = sum(e - s for s, e in r.idle_gaps[rank])
        assert idle + r.compute_time[rank] == pytest.approx(r.step_time)
    total_idle = sum(e - s for g in r.idle_gaps for s, e in g)
    assert r.idle_fraction == pytest.approx(total_idle / (4 * r.step_time))


def test_dependencies_respected_in_time():
    # forward of mb on stage s+1 starts after it ended on stage s; backward the other way
    r = simulate(build_schedule("interleaved", 4, 8, 2), Costs(1, 2, 0))
    at = {(i.name, i.micro_batch, i.stage): i for i in r.timeline}
    for (kind, mb, s), i in at.items():
        if kind == "F" and s > 0:
            assert i.t_start >= at[("F", mb, s - 1)].t_end
        if kind == "B" and s < 7:
            assert i.t_start >= at[("B", mb, s + 1)].t_end
        if kind == "B":
            assert i.t_start >= at[("F", mb, s)].t_end


def test_peak_activation_units_and_dict():
    r = simulate(build_schedule("interleaved", 4, 8, 2))
    assert r.peak_inflight[0] == 2 * 3 + 4 + 1
    assert r.peak_activation_units[0] == pytest.approx(5.5)
    d = r.to_dict()
    assert set(d) >= {"bubble_ratio", "idle_fraction", "peak_inflight", "timeline"}
    assert d["timeline"][0][:3] == [0, 0.0, 1.0]


def test_text_timeline_rows():
    r = simulate(build_schedule("1f1b", 4, 4))
    text = text_timeline(r)
    lines = text.splitlines()
    assert len(lines) == 5 and lines[1].startswith("rank  0 |F0")
    assert lines[4].split("|")[1].startswith(".")   # the last stage waits for the first forward


def test_costs_validated():
    with pytest.raises(ParallelLabError, match="f=0"):
        Costs(f=0)
    with pytest.raises(ParallelLabError, match="p2p"):
        Costs(p2p=-1)


# ---- `parallel-lab bubble` -------------------------------------------------------------------------

def _cli(capsys, *args):
    import json

    from parallel_lab.cli import main

    code = main(list(args))
    out, err = capsys.readouterr()
    return code, (json.loads(out) if "--json" in args and code == 0 else out), err


def test_bubble_cli_json_seed(capsys):
    for name in ("gpipe", "1f1b"):
        for m in (4, 8, 16, 32, 64):
            code, j, _ = _cli(capsys, "bubble", "--schedule", name, "--stages", "8", "--microbatches", str(m),
                              "--json")
            assert code == 0
            assert j["bubble_ratio"] == pytest.approx(7 / m, rel=1e-12)
            assert len(j["peak_inflight"]) == 8
            assert j["idle_fraction"] == pytest.approx(7 / (m + 7))
            rank, start, end, kind, mb, chunk = j["timeline"][0]
            assert (rank, start, kind, mb, chunk) == (0, 0.0, "F", 0, 0) and end == 1.0


def test_bubble_cli_text_and_costs(capsys):
    code, out, _ = _cli(capsys, "bubble", "--schedule", "zb-h1", "--stages", "4", "--microbatches", "8",
                        "--f", "1", "--b", "1", "--w", "1")
    assert code == 0 and "bubble_ratio  0.1250" in out and "rank  3 |" in out
    code, j, _ = _cli(capsys, "bubble", "--schedule", "interleaved", "--stages", "4", "--microbatches", "8",
                      "--interleave", "2", "--json")
    assert j["bubble_ratio"] == pytest.approx(3 / 16) and j["peak_inflight"][0] == 11


def test_bubble_cli_prints_the_schedules_own_formula(capsys):
    """Each schedule's line names its own closed form (not GPipe's for all); costs without one print none."""
    own = {"gpipe": "(p-1)/m", "1f1b": "(p-1)/m", "interleaved": "(p-1)/(v m)", "zb-v": "max(p-1, 4p-2m-2)/(6 m)",
           "dualpipev": "(p-1)/(3 m)", "zb-h1": "(2(p-1) - (min(m,p)-1))/(3 m), (p-1)/(3 m) once m >= p"}
    for name, text in own.items():
        extra = ["--interleave", "2"] if name == "interleaved" else []
        code, out, _ = _cli(capsys, "bubble", "--schedule", name, "--stages", "4", "--microbatches", "8", *extra)
        ratio = out.splitlines()[1]
        assert code == 0 and f"; {name}: {text}; closed form" in ratio, ratio
        assert ("(p-1)/(m+p-1)" in out.splitlines()[2]) == (name in ("gpipe", "1f1b"))
    code, j, _ = _cli(capsys, "bubble", "--schedule", "zb-h1", "--stages", "4", "--microbatches", "8", "--w", "2",
                      "--json")
    assert code == 0 and j["bubble_ratio_formula"] is None           # W longer than F or B: simulated only
    code, out, _ = _cli(capsys, "bubble", "--schedule", "zb-h1", "--stages", "4", "--microbatches", "8", "--w", "2")
    assert "closed form" not in out


def test_bubble_cli_errors(capsys):
    code, _, err = _cli(capsys, "bubble", "--schedule", "interleaved", "--stages", "4", "--microbatches", "6",
                        "--interleave", "2")
    assert code == 2 and "pick m in" in err


def test_timeline_stats_by_hand_and_only_compute_counts():
    ivs = [Interval(0, "compute", "F", 0.0, 1.0, 0), Interval(1, "compute", "F", 1.0, 2.0, 0),
           Interval(0, "comm", "pp:send", 1.0, 1.5), Interval(0, "compute", "B", 2.0, 3.0, 0)]
    st = timeline_stats(ivs)                         # window 0..3; busy: rank 0 2, rank 1 1
    assert st.busy == {0: 2.0, 1: 1.0} and st.step_time == 3.0
    assert st.bubble_ratio == 0.5 and st.idle_fraction == 0.5    # (3 - 2) / 2 and 1 - 3 / (2 * 3)
    assert timeline_stats(ivs, 0.0, 4.0, ranks=4).idle_fraction == 1 - 3 / 16
    assert Interval.from_row(ivs[0].as_row()) == ivs[0]
