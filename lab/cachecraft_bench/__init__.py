"""cachecraft_bench: the lab that proves cachecraft's claims: workloads, the quality, serving,
decode, model and store benchmarks, the vLLM peer, the baselines and ablations, and reports.

It uses only cachecraft's public modules (tests/test_layers.py checks it), registers its reuse
strategies into cachecraft's registry, and adds `cachecraft bench` and `cachecraft calibrate`
through the `cachecraft.commands` entry point (cli.py). The product never imports it.
"""
