"""What a compiled program offers to look at: costs, memory, schedule pictures, traces."""
