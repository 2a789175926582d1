"""sched"""
