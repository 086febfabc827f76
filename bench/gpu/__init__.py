"""The device's scripts (one H200 or more): ``python -m bench.gpu.<name>``; the shell scripts
beside them (session.sh, short_call.sh, run_all.sh, quality_session.sh) run them that way.
"""
