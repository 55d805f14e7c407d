"""Choose a Plan for a workload on a device."""
