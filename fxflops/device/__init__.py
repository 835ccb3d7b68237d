"""The machine side: peak rates of known devices and the roofline that predicts time from them."""
