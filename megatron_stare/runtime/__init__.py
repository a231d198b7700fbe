"""The process lifecycle: the parallel layout and process groups, rendezvous, preemption, step interrupts and the reaper of leftover children."""
