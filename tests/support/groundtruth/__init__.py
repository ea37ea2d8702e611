"""The ground-truth checker (issue 16 item 1; design.md, "Evidence rules"): randomized
schedules of real writers on simulated nodes, checked against every agent's journal and
/metrics.

    schedule.py   seeded schedules of rounds (together, staggered, sequential; exits, kills)
    writer.py     the writer program: one rank, its true intervals logged on the host's clock
    writers.py    the writer processes of one simulated job, under `ckptwatch run`
    truth.py      the truth log: true intervals, kills
    collect.py    what each agent said: its journal's records and its /metrics
    expect.py     what the truth allows on one path, with the stated TOLERANCE (pure)
    compare.py    the checker: agents' journals and /metrics against the truth (pure)
    trial.py      one trial: store, agents, writers, rounds, observation, verdict
    load.py       CPU load: busy processes at twice the core count

Used by tests/e2e/test_groundtruth.py (a fixed-seed batch) and bench/groundtruth.py (many
seeds, precision and recall per kind and per agent).
"""
