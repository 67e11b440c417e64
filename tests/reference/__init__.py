"""Clean-room reference implementations used as test oracles and benchmark baselines."""
