"""Research tools: depth-role analysis, P × L × order × seed sweeps and their reports."""
