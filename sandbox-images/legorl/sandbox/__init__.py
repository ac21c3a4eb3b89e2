"""Trial sandboxes: the four stages (image, setup, agent, verify), their defenses and backends.

Standard library only: the setup and verify stages run inside arbitrary task images.
"""
