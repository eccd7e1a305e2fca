"""`python -m ckptctl` runs the command-line tool."""

from ckptctl.cli.app import main

main()
