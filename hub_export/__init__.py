"""Tools around the Hub code files: building, converting, exporting and pushing spike_whale folders."""
