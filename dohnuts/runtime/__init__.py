"""What runs the network: `Predictor`, CUDA graphs (prediction, vision, training) and their
buckets, the training update, batched evaluation, processes, and the one checkpoint module."""
