"""Attacks on what each method shares, and their scores: the measurements behind ``docs/privacy.md``.

The attacks read payloads and models; they never touch the training path. ``tools.privacy`` runs them
on the payloads a finished run recorded (run config ``record-payloads``).
"""
