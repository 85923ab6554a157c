"""Discrete-event simulation of a Tandem cluster on Tandem's own schedulers (``tandem sim``,
``tandem plan``). docs/sim.md describes it; sim.adapter is the one module touching the real
engine Scheduler and router placement classes."""
