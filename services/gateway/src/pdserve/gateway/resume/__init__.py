"""Requests that outlive their client connection and their gateway (background responses,
resumable streams): what every gateway can read about them (`store`), and the runs this
gateway holds (`runs`)."""
