"""Window selection and batch gathering: index in, indices and copied batches out."""
