"""`python -m moerun` runs the command line."""
from moerun.cli import main

main()
