"""The training loops (train.py, train_async.py) and the job they run on."""
