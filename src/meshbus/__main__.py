from meshbus.cli.main import main

main()
