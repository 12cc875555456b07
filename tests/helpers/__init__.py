"""Shared test helpers: real gloo processes (`dist`), script runs (`procs`), digits models (`digits`)."""
