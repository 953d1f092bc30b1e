"""The command line: click commands and rich rendering, nothing else."""
