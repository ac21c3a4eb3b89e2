"""What runs inside vLLM: the weight-transfer worker extension and the weight-version middleware."""
