"""pivotrl: RL post-training with a generative reward model, with devices that
shift between rollout, judge and training roles while a step runs."""

__version__ = "0.1.0"
