"""The long-running service: APScheduler jobs, signals, sd_notify, Prometheus metrics."""
