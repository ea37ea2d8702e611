"""monitor.ingest.server's connection caps in the real agent process (the caps themselves,
on an IngestServer in the test's process, are tests/unit/test_ingest_limits.py)."""
from agentproc import FAST, overlapping_writes, start_agent
from wire import hold


def test_real_agent_one_process_holding_1024_connections_cannot_blind_it(tmp_path):
    # The scenario end to end: one process opens 1,024 connections and keeps them;
    # two real writers still get their collision reported, the refusals are a metric, and
    # the log holds a line or two instead of one per refusal.
    with start_agent(str(tmp_path), *FAST) as agent:
        held = hold(agent.socket, 1024)
        try:
            overlapping_writes(agent, "/ckpt/blind.pt")
            agent.wait_for_collision()
            refused = agent.metric("ckptwatch_ingest_connections_refused_total",
                                   reason="pid_limit")
            assert refused == 1024 - 16
            assert agent.log.count("refusing connection") == 1, agent.log[-2000:]
        finally:
            for s in held:
                s.close()
