"""Test oracles: ``stock_replay`` draws fastload's records the stock YOLOv9 way (the stock loader itself is
fastload.bench.stock); ``official`` runs the official YOLOv9 code from a temporary copy, and ``official_bridge`` is
our script that calls it from inside that copy (trainer parity, issue #18); ``geometry_replay`` runs the official
segment loader and Ultralytics' segment / pose / obb label code on fastload's records and draws (issue #37)."""
