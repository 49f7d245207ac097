"""pdserve.v1: Python code generated from protos/pdserve/v1 by `make proto`. Do not edit."""
