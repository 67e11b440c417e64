"""Test oracles: ``stock_replay`` draws fastload's records the stock YOLOv9 way (the stock loader itself is fastload.bench.stock)."""
