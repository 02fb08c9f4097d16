"""Pre-launch planning: compile a run's real train step for a TPU slice (or CPUs) without one.

    python -m delta_jax.plan --config configs/8b.yaml --topology v5p:4x4x4

Modules: chips (HBM and peak FLOP/s per TPU chip), topology (names -> devices), compile (the
trainer's step, compiled; memory and cost per device), report (fits, estimates, tables), knobs
(the alternatives tried when a run does not fit), where (the smallest slice each config trains
on), floors (what routing cannot avoid, from the schedule), __main__ (the command line).
"""
