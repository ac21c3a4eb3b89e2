"""Observability shared by every component: trial traces (`traces`) and Prometheus metrics (`metrics`).

Light on purpose: importing either module needs neither OpenTelemetry nor prometheus-client; they are
imported when a trace is emitted or metrics are served, and without an exporter nothing runs at all.
"""
