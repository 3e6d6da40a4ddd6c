"""tfsmp.partitioning"""
