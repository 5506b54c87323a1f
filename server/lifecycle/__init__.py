"""A run's life across the domains: creation, status changes, the view with its round."""
