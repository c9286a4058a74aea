"""testbed"""
