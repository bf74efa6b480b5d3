"""Parents with real daemon processes: equivalence with all-local, faults and supervision, placement, launch and
systemd."""
