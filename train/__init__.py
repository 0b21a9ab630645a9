"""Training for dm_jax hybrid language models: `python -m train --help`.

Programmatic API:
    train.config.RunConfig, train.config.parse_args(argv) -> RunConfig
    train.loop.train(run_config, *, progress=True) -> TrainResult
    train.loop.load_model(run_dir_or_checkpoint) -> (model, run_config)
"""
