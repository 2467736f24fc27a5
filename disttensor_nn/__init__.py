"""disttensor_nn: CNN layers that train on samples split over ranks (by sample and spatially)."""
