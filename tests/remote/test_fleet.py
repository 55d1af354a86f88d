"""A real fleet on loopback: two vLLM replicas (CPU build, the default model exported) behind vllm-router. Each of 64
requests through the router is attributed to a replica by the span that replica exported (engine.remote.fleet); the
check is the replicas' own accounts: the request id in the log of the replica it was attributed to and in no other
(`--enable-log-requests`), and each replica's /metrics request counter. Then round-robin against cache-aware routing on
shared-prefix prompts, TTFT p50 for each. Bounded: 2 replicas, 2 routers one after the other, 2 × 64 requests of 2
tokens; everything is stopped after."""

from __future__ import annotations

import pytest

from engine.remote import fleet as fl
from tests.requires import missing

pytestmark = pytest.mark.server

N = 64


@pytest.fixture(scope="module")
def fleet_servers(request, server_logs):
    from tests.remote import servers

    if not servers.VLLM_PY.exists():
        missing("servers", f"vLLM's virtual environment is missing ({servers.VLLM_PY})")
    if fl.router_python() is None:
        missing("servers", f"vllm-router is not installed in {servers.VENVS / 'vllm'}")
    exported_hf = request.getfixturevalue("exported_hf")  # after the checks: a missing server fails at once
    with fl.launched(exported_hf, server_logs, replicas=2) as started:
        yield started


@pytest.fixture(scope="module")
def runs(fleet_servers, server_logs):
    """One run per policy through its own router (started and stopped here), each on prefixes of its own."""
    reps = tuple(fl.Replica(url=s.url, name=f"replica {i + 1}") for i, (s, _) in enumerate(fleet_servers))
    out = {}
    for salt, policy in enumerate(("round_robin", "cache_aware")):
        router = fl.start_router([r.url for r in reps], policy, server_logs)
        try:
            fleet = fl.Fleet(router=router.url, replicas=reps,
                             receivers={r.url: rx for r, (_, rx) in zip(reps, fleet_servers, strict=True)})
            listed = fl.Fleet.from_router(router.url).replicas  # the router's own listing (in an order of its own)
            assert sorted(r.url for r in listed) == sorted(r.url for r in reps)
            out[policy] = fl.run_policy(fleet, router.url, policy, num_prompts=N, max_new_tokens=2, concurrency=4,
                                        time_limit_s=300, salt=salt)
        finally:
            router.stop()
    print({p: (r["ttft_p50_ms"], r["served"], r["prefix_affinity"]) for p, r in out.items()})
    return out, {f"replica {i + 1}": fl.logged_requests(s.log.read_text(errors="replace"))
                 for i, (s, _) in enumerate(fleet_servers)}


@pytest.mark.parametrize("policy", ["round_robin", "cache_aware"])
def test_each_request_is_attributed_to_the_replica_whose_own_log_and_counter_have_it(runs, policy):
    got, logs = runs
    run = got[policy]
    assert run["completed"] == N and run["failed"] == 0, run["errors"]
    assert run["attributed"] == N and run["problems"] == []
    for r in run["requests"]:
        engine_id = r["response_id"] + "-0"  # vLLM's engine request: the completion's id and the prompt's index
        holders = [name for name, ids in logs.items() if engine_id in ids]
        assert holders == [r["replica"]], (r, holders)
    # each replica's own counter of finished requests moved by what was attributed to it
    assert run["replica_counted"] == {k: float(v) for k, v in run["served"].items()}


def test_round_robin_against_cache_aware_on_shared_prefixes(runs):
    got, _ = runs
    rr, ca = got["round_robin"], got["cache_aware"]
    for run in (rr, ca):
        assert run["ttft_p50_ms"] is not None and run["ttft_p50_ms"] > 0
        assert run["ttft_p50_ms"] == pytest.approx(fl.p50([r["ttft_ms"] for r in run["requests"]]))
        assert 0 < run["prefix_affinity"] <= 1
        # each prefix came back to a replica that had cached it: hits in the replicas' own counters, whatever routed
        assert run["prefix_hit_rate"] is not None and run["prefix_hit_rate"] > 0
    # round-robin alternates between the two replicas (the router also sends them the Load lab's /metrics scrapes
    # and the probe's requests in turn, so not exactly half each): neither is left with few
    assert min(rr["served"].values()) >= N // 4, rr["served"]
