"""Fault injection: the iptables rule plan and the firewall that applies it."""
