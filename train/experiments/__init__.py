"""Experiments: train every attention arm from one initialization and compare them
(`python -m train.experiments.compare`)."""
