"""The warm start: recorded demonstrations and the fine-tuning that makes the builtin starting policies."""
