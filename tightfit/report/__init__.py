"""What happened, measured: metrics, summaries, diagnoses."""
